"""Files kvcalib reads and writes. Every file a user gives is untrusted: it is opened only
as a regular file inside its folder, and read with bounds. Every output appears whole or
not at all: written beside its target, made durable, then moved into place.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from kvcalib.errors import CheckpointError, UsageError

# What --overwrite does, as atomic_output_dir does it (run and convert).
OVERWRITE_HELP = "Replace a non-empty --output (only once the new checkpoint is complete)."

# ----- reading untrusted files ----- #

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


# ----- writing outputs ----- #


def check_output_target(output: Path, model_dir: Path | None, overwrite: bool) -> Path:
    """Refuse targets that would lose data; return the absolute target path."""
    target = Path(os.path.abspath(Path(output).expanduser()))
    if model_dir is not None:
        model = Path(model_dir).resolve()
        resolved = target.resolve()
        if resolved == model or model in resolved.parents:
            raise UsageError(f"--output {output} is inside the input model folder {model}; "
                             "the input is never modified")
        if resolved in model.parents:
            raise UsageError(f"--output {output} contains the input model folder {model}")
    if target.exists():
        if not target.is_dir():
            raise UsageError(f"--output {output} exists and is a file")
        if any(target.iterdir()) and not overwrite:
            raise UsageError(f"--output {output} exists and is not empty; "
                             "pass --overwrite to replace it")
    if not target.parent.is_dir():
        raise UsageError(f"the parent folder of --output does not exist: {target.parent}")
    _check_writable_folder(target.parent, "--output", output)
    return target


def check_output_file(path: Path, option: str) -> Path:
    """Refuse, before any work, an output file that cannot be written whole: a folder, a
    device or pipe (/dev/full accepts the open and fails the write), a path under a file,
    an unwritable place. Returns the absolute path; a link is followed, so the file it
    names is the one replaced."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise UsageError(f"{option} {path} is a folder; give a file name")
    if target.exists():
        if not target.is_file():
            raise UsageError(f"{option} {path} is not a regular file (a device or pipe); "
                             "kvcalib writes output files whole")
        if not os.access(target, os.W_OK):
            raise UsageError(f"{option} {path} is not writable")
    _check_writable_folder(target.parent, option, path)
    return target.resolve()


def check_output_folder(path: Path, option: str) -> Path:
    """Refuse, before any work, an output folder that is a file or cannot be created."""
    target = Path(path).expanduser()
    _check_writable_folder(target, option, path)
    return Path(os.path.abspath(target))


def _check_writable_folder(folder: Path, option: str, path: Path) -> None:
    """The nearest existing folder at or above `folder` must be a folder we can write in
    (missing ones are created when the output is written). Proven by creating and removing
    a file there: os.access says yes to root where nothing can be created (/proc)."""
    for existing in [folder, *Path(os.path.abspath(folder)).parents]:
        if existing.exists():
            if not existing.is_dir():
                raise UsageError(f"{option} {path}: {existing} is a file, not a folder")
            try:
                fd, probe = tempfile.mkstemp(prefix=".kvcalib-probe-", dir=existing)
            except OSError as exc:
                raise UsageError(f"{option} {path}: cannot write in {existing} "
                                 f"({exc.strerror})") from None
            os.close(fd)
            os.unlink(probe)
            return


def refuse_outputs_in_inputs(inputs: list[Path | str | None],
                             outputs: dict[str, Path | None]) -> None:
    """Refuse, before any work, an output (option -> path) that is an input or lies inside
    an input folder: compared resolved through symbolic links, and an existing file also
    by inode (a hard link to an input's file). Inputs that are not local paths (hub ids)
    are skipped."""
    sources = [Path(p).expanduser() for p in inputs if p is not None]
    sources = [p for p in sources if p.exists()]
    roots = [root for p in sources if p.is_dir() for root in allowed_roots(p)]
    for option, path in outputs.items():
        if path is None:
            continue
        real = Path(path).expanduser().resolve()
        for source in sources:
            if real == source.resolve():
                raise UsageError(f"{option} {path} is the input {source}; the input is never "
                                 "modified")
        for root in roots:
            if root in real.parents:
                raise UsageError(f"{option} {path} is inside the input folder {root}; the "
                                 "input is never modified")
        linked = _same_file_among(real, sources)
        if linked is not None:
            raise UsageError(f"{option} {path} is a hard link to the input's {linked}; the "
                             "input is never modified")


def _same_file_among(path: Path, sources: list[Path]) -> Path | None:
    """An input file that is `path` under another name (a hard link), if any."""
    try:
        info = path.stat()
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_nlink < 2:
        return None
    for source in sources:
        for candidate in ([source] if source.is_file() else source.rglob("*")):
            with contextlib.suppress(OSError):
                if os.path.samestat(candidate.stat(), info):
                    return candidate
    return None


@contextmanager
def atomic_output_file(target: Path) -> Iterator[Path]:
    """Yield a temporary file beside `target`; it replaces `target` only once complete."""
    target = Path(target)
    _remove_stale_temporaries(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=_temporary_prefix(target), dir=target.parent)
    except OSError as exc:
        raise UsageError(f"cannot write {target}: {exc}") from None
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _make_durable(tmp, _umask())
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"writing {target} failed: {exc}; nothing was written there") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def new_file(path: Path) -> Iterator[BinaryIO]:
    """Open a file that will become `path`, which must not exist yet.

    The bytes go to a temporary file created exclusively (O_EXCL) beside `path`, which is
    then linked to `path` (failing if that name was taken) and unlinked. So nothing is
    ever opened for writing through an existing name: a hard link to an input file, or a
    file written a moment before under the same name, is refused rather than overwritten.
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
        os.link(name, path)
    finally:
        os.unlink(name)


def write_new(path: Path, data: bytes) -> None:
    """`data` as the new file `path` (see new_file: an existing file is never written)."""
    with new_file(path) as f:
        f.write(data)


@contextmanager
def atomic_output_dir(target: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside `target`; move it into place only on success.

    A crash or interrupt leaves nothing at `target`. Without `overwrite`, the move fails
    when `target` appeared meanwhile (another run finished there first); with it, an
    existing `target` is kept until the new folder is complete.
    """
    target = Path(target)
    _remove_stale_temporaries(target)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=_temporary_prefix(target), dir=target.parent))
    except OSError as exc:
        raise UsageError(f"cannot write to {target.parent}: {exc}") from None
    try:
        yield tmp
        umask = _umask()
        for path in tmp.rglob("*"):
            if path.is_file():
                _make_durable(path, umask)
        tmp.chmod(0o777 & ~umask)
        if overwrite and os.path.lexists(target):
            _replace_folder(tmp, target)
        else:
            _remove_empty_folder(target)
            rename_noreplace(tmp, target)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise UsageError(f"{target} appeared while this run was working (another run "
                             "writing there?); it was left as it is, and this run's result "
                             "was discarded") from None
        raise UsageError(f"writing {target} failed: {exc}; nothing was written there") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_folder(new: Path, target: Path) -> None:
    """Swap `new` in for `target`; the old folder is removed only once `new` is in place."""
    old = target.parent / f".{target.name}.kvcalib-old-{uuid.uuid4().hex[:8]}"
    os.rename(target, old)
    try:
        rename_noreplace(new, target)
    except OSError:
        with contextlib.suppress(OSError):
            rename_noreplace(old, target)
        raise
    if old.is_symlink():
        old.unlink()
    else:
        shutil.rmtree(old)


def _remove_empty_folder(target: Path) -> None:
    """Remove the empty folder (or link to one) check_output_target accepted at `target`.
    Anything put there since stays, and the rename then refuses to replace it."""
    with contextlib.suppress(OSError):
        if not target.is_symlink():
            target.rmdir()
        elif not any(target.iterdir()):
            target.unlink()


# From <linux/fs.h> and <fcntl.h>.
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_LIBC = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_LIBC, "renameat2", None)  # glibc >= 2.28


def rename_noreplace(src: Path, dst: Path) -> None:
    """Move the folder `src` to `dst`, failing with FileExistsError when `dst` exists,
    even if it appeared a moment ago.

    Linux's renameat2(RENAME_NOREPLACE) checks and renames in one step. Where it is
    missing (other systems, filesystems such as NFS that refuse the flag), creating `dst`
    with mkdir claims the name just as atomically, and rename(2) then replaces that empty
    folder, which POSIX allows only while it is empty.
    """
    if _renameat2 is not None:
        if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
                      _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(code, os.strerror(code), str(src), None, str(dst))
    os.mkdir(dst)
    try:
        os.rename(src, dst)
    except OSError:
        with contextlib.suppress(OSError):
            os.rmdir(dst)
        raise


def _temporary_prefix(target: Path) -> str:
    return f".{target.name}.kvcalib-tmp-{os.getpid()}-"


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _make_durable(path: Path, umask: int) -> None:
    """Usual permissions (mkstemp and some writers create 0600 files), bytes on disk."""
    if path.stat().st_nlink == 1:  # a hard link's mode is the input file's
        path.chmod(0o666 & ~umask)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _remove_stale_temporaries(target: Path) -> None:
    """Remove temporary files and folders that killed runs left beside `target`."""
    for path in target.parent.glob(f".{target.name}.kvcalib-tmp-*"):
        pid = path.name.removeprefix(f".{target.name}.kvcalib-tmp-").split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    write_text(path, json.dumps(payload, indent=1) + "\n")


def write_text(path: Path, text: str) -> None:
    """Replace `path` whole (missing folders are created): a reader never sees half a file."""
    with atomic_output_file(path) as tmp:
        tmp.write_text(text)
