"""Checkpoint I/O: find a model folder, read safetensors headers and single tensors
without loading weights, and write output folders atomically.

Only numpy is needed here, so that static checks stay fast on checkpoints of any size.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvcalib.errors import CheckFailed, UsageError

INDEX_NAME = "model.safetensors.index.json"
# Header sizes above this are corrupt, not large: a 1 TB model's header is a few MB.
MAX_HEADER_BYTES = 100 * 2**20
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a hub model download fetches (`estimate` fetches only config.json).
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


class CheckpointError(CheckFailed):
    """The checkpoint's files are malformed (truncated, bad index, bad header)."""


# ----- finding a model ----- #


def resolve_model(ref: str) -> Path:
    """A local folder as is, or a hub id downloaded to (or found in) the HF cache."""
    path = Path(ref).expanduser()
    if path.exists():
        if not path.is_dir():
            raise UsageError(f"model path {ref} is a file; pass the model's folder")
        if not (path / "config.json").is_file():
            raise UsageError(f"{ref} has no config.json: it is not a Hugging Face model folder")
        return path.resolve()
    _check_hub_id(ref)
    return _download_from_hub(ref, MODEL_FILES)


def resolve_config(ref: str) -> dict[str, Any]:
    """config.json of a local folder, a config file itself, or a hub id (fetching only that
    file), for commands that need the model's shape but not its weights."""
    path = Path(ref).expanduser()
    if path.is_file():
        folder, name = path.parent, path.name
    elif path.is_dir():
        folder, name = path, "config.json"
    else:
        _check_hub_id(ref)
        folder, name = _download_from_hub(ref, ["config.json"]), "config.json"
    return load_config(folder, name)


def _check_hub_id(ref: str) -> None:
    if not HUB_ID.match(ref) or ref.startswith((".", "/", "~")):
        raise UsageError(f"model folder not found: {ref}")


def _download_from_hub(repo_id: str, patterns: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    from kvcalib.hub import hub_reachable

    offline = not hub_reachable()
    try:
        folder = snapshot_download(repo_id, allow_patterns=patterns, local_files_only=offline)
    except Exception as exc:  # the hub client raises many types; all mean "not available"
        where = "the Hugging Face Hub cannot be reached and it is not in the local cache"
        if not offline:
            where = f"downloading it failed: {exc}"
        raise UsageError(f"model {repo_id!r} is not a local folder, and {where}") from exc
    return Path(folder)


def load_config(folder: Path, name: str = "config.json") -> dict[str, Any]:
    """A model config as a dict; anything else is a clear error (verify reports it)."""
    path = Path(folder) / name
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"{folder} has no {name}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise UsageError(f"{path} is not a model config (a JSON object)")
    return config


# ----- reading safetensors without loading weights ----- #


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes sit, from the file's header."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The JSON header and the offset where tensor data starts; validated against size."""
    size = path.stat().st_size
    with open(path, "rb", buffering=0) as f:  # unbuffered: read the header and nothing more
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path.name}: truncated: {size} bytes, no safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise CheckpointError(
                f"{path.name}: truncated or corrupt: header claims {length} bytes, "
                f"file has {size}"
            )
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path.name}: header is not valid JSON: {exc}") from None
    data_start = 8 + length
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    if ends and data_start + max(ends) > size:
        raise CheckpointError(
            f"{path.name}: truncated: its header declares {data_start + max(ends)} bytes, "
            f"the file has {size}"
        )
    return header, data_start


def file_tensors(path: Path) -> dict[str, TensorInfo]:
    header, data_start = read_header(path)
    return {
        name: TensorInfo(
            name,
            path,
            entry["dtype"],
            tuple(entry["shape"]),
            data_start + entry["data_offsets"][0],
            data_start + entry["data_offsets"][1],
        )
        for name, entry in header.items()
        if name != "__metadata__"
    }


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files a loader would read: the index's, or every file present."""
    folder = Path(folder)
    index_path = folder / INDEX_NAME
    if not index_path.exists():
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder} has no .safetensors files")
        return files
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{INDEX_NAME}: not a valid index ({exc})") from None
    files = []
    for name in sorted(set(weight_map.values())):
        # Lexical check: files may be symlinks (the Hugging Face cache links into blobs/).
        if Path(name).is_absolute() or os.path.normpath(name).startswith(".."):
            raise CheckpointError(f"{INDEX_NAME} points outside the checkpoint folder: {name}")
        path = folder / os.path.normpath(name)
        if not path.is_file():
            raise CheckpointError(f"{INDEX_NAME} points to a missing file: {name}")
        files.append(path)
    return files


def tensor_index(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint, from the headers only."""
    index: dict[str, TensorInfo] = {}
    for path in weight_files(folder):
        for name, info in file_tensors(path).items():
            if name in index:
                raise CheckpointError(f"tensor {name} is in both {index[name].file.name} "
                                      f"and {path.name}")
            index[name] = info
    return index


def _fp8_table(exponent_bits: int, mantissa_bits: int) -> np.ndarray:
    """All 256 values of an FP8 format (OCP E4M3FN or E5M2), for decoding stored bytes."""
    bias = 2 ** (exponent_bits - 1) - 1
    codes = np.arange(256)
    sign = np.where(codes >> 7, -1.0, 1.0)
    exponent = (codes >> mantissa_bits) & (2**exponent_bits - 1)
    mantissa = codes & (2**mantissa_bits - 1)
    normal = (1 + mantissa / 2**mantissa_bits) * 2.0 ** (exponent - bias)
    subnormal = (mantissa / 2**mantissa_bits) * 2.0 ** (1 - bias)
    values = sign * np.where(exponent == 0, subnormal, normal)
    if exponent_bits == 4:  # E4M3FN: only S.1111.111 is NaN, no infinities
        values[(codes & 0x7F) == 0x7F] = np.nan
    else:
        top = exponent == 2**exponent_bits - 1
        values[top] = np.where(mantissa[top] == 0, sign[top] * np.inf, np.nan)
    return values


_NUMPY_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4",
                 "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}
_FP8 = {"F8_E4M3": (4, 3), "F8_E5M2": (5, 2)}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", *_FP8}


def read_tensor(info: TensorInfo) -> np.ndarray:
    """One tensor's values as float64 (or its integer type); reads only its bytes."""
    with open(info.file, "rb", buffering=0) as f:
        f.seek(info.start)
        raw = f.read(info.end - info.start)
    if info.dtype == "BF16":
        bits = np.frombuffer(raw, "<u2").astype(np.uint32) << 16
        values = bits.view(np.float32).astype(np.float64)
    elif info.dtype in _FP8:
        values = _fp8_table(*_FP8[info.dtype])[np.frombuffer(raw, "u1")]
    elif info.dtype in _NUMPY_DTYPES:
        values = np.frombuffer(raw, _NUMPY_DTYPES[info.dtype])
        if values.dtype.kind == "f":
            values = values.astype(np.float64)
    else:
        raise CheckpointError(f"{info.name}: unsupported dtype {info.dtype}")
    count = int(np.prod(info.shape)) if info.shape else 1
    if values.size != count:
        raise CheckpointError(f"{info.name}: {values.size} values stored, shape {info.shape} "
                              f"needs {count}")
    return values.reshape(info.shape)


def copy_tensors(src: Path, dst: Path, drop: set[str]) -> None:
    """Write `src` without the tensors in `drop`; every kept tensor's bytes are unchanged."""
    header, _ = read_header(src)
    kept = {k: v for k, v in file_tensors(src).items() if k not in drop}
    new_header: dict[str, Any] = {}
    if "__metadata__" in header:
        new_header["__metadata__"] = header["__metadata__"]
    offset = 0
    for name, info in sorted(kept.items(), key=lambda kv: kv[1].start):
        new_header[name] = {"dtype": info.dtype, "shape": list(info.shape),
                            "data_offsets": [offset, offset + info.end - info.start]}
        offset += info.end - info.start
    blob = json.dumps(new_header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned, as safetensors does
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        fout.write(struct.pack("<Q", len(blob)) + blob)
        for info in sorted(kept.values(), key=lambda i: i.start):
            fin.seek(info.start)
            remaining = info.end - info.start
            while remaining:
                chunk = fin.read(min(remaining, 64 * 2**20))
                fout.write(chunk)
                remaining -= len(chunk)


# ----- writing output folders ----- #


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
    return target


@contextmanager
def atomic_output_dir(target: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `target`; move it into place only on success.

    A crash or interrupt leaves nothing at `target`, and an existing `target` is kept
    until the new folder is complete.
    """
    target = Path(target)
    _remove_stale_temporaries(target)
    prefix = f".{target.name}.kvcalib-tmp-{os.getpid()}-"
    try:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    except OSError as exc:
        raise UsageError(f"cannot write to {target.parent}: {exc}") from None
    try:
        yield tmp
        umask = os.umask(0)
        os.umask(umask)
        for path in tmp.rglob("*"):
            if path.is_file():
                if path.stat().st_nlink == 1:  # a hard link's mode is the input file's
                    path.chmod(0o666 & ~umask)  # some writers create 0600 files
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        tmp.chmod(0o777 & ~umask)
        if target.exists():
            old = target.parent / f".{target.name}.kvcalib-old-{uuid.uuid4().hex[:8]}"
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old)
        else:
            os.rename(tmp, target)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UsageError(f"writing {target} failed: {exc}; nothing was written there") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove_stale_temporaries(target: Path) -> None:
    """Remove temporary folders that killed runs left beside `target`."""
    for path in target.parent.glob(f".{target.name}.kvcalib-tmp-*"):
        pid = path.name.removeprefix(f".{target.name}.kvcalib-tmp-").split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)
