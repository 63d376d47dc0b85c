"""Reading the files a user gives, which are untrusted: each is opened only as a regular
file inside its folder, and read with bounds; malformed JSON is one CheckpointError."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from kvcalib.errors import CheckpointError

# A real config, index or report is at most a few MB; larger is corrupt, not large.
MAX_JSON_BYTES = 64 * 2**20


def allowed_roots(folder: Path) -> tuple[Path, ...]:
    """Where the files of a checkpoint folder may really live: inside the folder, and for a
    Hugging Face cache snapshot (models--ORG--NAME/snapshots/REV, whose files are links
    into ../../blobs) inside that repository's blobs folder."""
    real = Path(folder).resolve()
    roots = [real]
    snapshots, repo = real.parent, real.parent.parent
    if snapshots.name == "snapshots" and repo.name.startswith(("models--", "datasets--")):
        roots.append(repo / "blobs")
    return tuple(roots)


def open_file(folder: Path, name: str) -> BinaryIO:
    """Open `folder/name` for reading: only a regular file, only where allowed_roots says.

    O_NONBLOCK: opening a FIFO (or a device) must not wait for a writer; it is refused
    right after, by its type.
    """
    path = Path(folder) / name
    real = path.resolve()
    if not any(real.is_relative_to(root) for root in allowed_roots(folder)):
        raise CheckpointError(f"{name} is a link to a file outside the checkpoint folder")
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise CheckpointError(f"{name} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"cannot open {name}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{name} is not a regular file")
    return os.fdopen(fd, "rb", buffering=0)


def read_bounded(folder: Path, name: str, what: str) -> bytes:
    """A small file of a checkpoint (JSON, a README), read whole up to MAX_JSON_BYTES."""
    with open_file(folder, name) as f:
        raw = f.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise CheckpointError(f"{name} is larger than {MAX_JSON_BYTES // 2**20} MiB: not a "
                              f"{what}")
    return raw


def read_json(folder: Path, name: str, what: str = "JSON") -> Any:
    """A JSON file of a checkpoint, bounded in size and depth."""
    return parse_json(read_bounded(folder, name, what), name)


def parse_json(raw: bytes, name: str) -> Any:
    """JSON from bytes; malformed text, bad UTF-8 and absurd nesting are one clear error."""
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except UnicodeDecodeError:
        raise CheckpointError(f"{name} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{name} is not valid JSON: {exc.msg} at line {exc.lineno} "
                              f"column {exc.colno}") from None
    except RecursionError:
        raise CheckpointError(f"{name} is not valid JSON: nested too deeply") from None
    except ValueError as exc:  # a duplicate key, from _no_duplicate_keys
        raise CheckpointError(f"{name} is not valid JSON: {exc}") from None


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))
        raise ValueError(f"key {twice!r} appears twice")
    return result


def load_config(folder: Path, name: str = "config.json") -> dict[str, Any]:
    """A model config as a dict; anything else is a clear error (verify reports it)."""
    if not (Path(folder) / name).exists() and not (Path(folder) / name).is_symlink():
        raise CheckpointError(f"{folder} has no {name}")
    config = read_json(folder, name, what="model config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{name} is not a model config (a JSON object)")
    return config
