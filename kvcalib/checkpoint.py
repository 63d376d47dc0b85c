"""Checkpoint I/O: find a model folder, read safetensors headers and single tensors
without loading weights, and write outputs (folders and files) atomically.

Only numpy is needed here, so that static checks stay fast on checkpoints of any size.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import math
import os
import re
import shutil
import stat
import struct
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from kvcalib.errors import UsageError

INDEX_NAME = "model.safetensors.index.json"
# Header sizes above this are corrupt, not large: a 1 TB model's header is a few MB.
MAX_HEADER_BYTES = 100 * 2**20
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a hub model download fetches (`estimate` fetches only config.json).
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


class CheckpointError(UsageError):
    """A file of the checkpoint is malformed, missing or not where it may be (exit 2; verify
    reports it as a failed check instead)."""


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
    if not (Path(folder) / name).exists() and not (Path(folder) / name).is_symlink():
        raise CheckpointError(f"{folder} has no {name}")
    config = read_json(folder, name, what="model config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{name} is not a model config (a JSON object)")
    return config


# ----- opening the files a checkpoint contains: all of them are untrusted input ----- #

# A real config, index or report is at most a few MB; larger is corrupt, not large.
MAX_JSON_BYTES = 64 * 2**20
# safetensors' own limit (MAX_HEADER_SIZE); a 1 TB model's header is a few MB.
MAX_HEADER_BYTES = 100_000_000


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


def read_json(folder: Path, name: str, what: str = "JSON") -> Any:
    """A JSON file of a checkpoint, bounded in size and depth."""
    with open_file(folder, name) as f:
        raw = f.read(MAX_JSON_BYTES + 1)
    if len(raw) > MAX_JSON_BYTES:
        raise CheckpointError(f"{name} is larger than {MAX_JSON_BYTES // 2**20} MiB: not a "
                              f"{what}")
    return parse_json(raw, name)


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


# Bits per element of every dtype safetensors 0.8 knows (its Dtype enum).
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8,
              "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16,
              "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64,
              "F64": 64, "I64": 64, "U64": 64}


def file_tensors(folder: Path, name: str) -> dict[str, TensorInfo]:
    """Every tensor of one safetensors file, from its header (see read_header)."""
    return read_header(folder, name)[0]


def read_header(folder: Path, name: str) -> tuple[dict[str, TensorInfo], dict[str, str] | None]:
    """The tensors and metadata of one safetensors file, validated as the format's spec
    and the safetensors library do: each entry names a known dtype, a shape of
    non-negative integers and a byte range of exactly shape x dtype size; the ranges are
    contiguous, do not overlap and cover the data to the file's last byte.

    Values of a file that fails to parse are never echoed: the file may be anything.
    """
    path = Path(folder) / name
    with open_file(folder, name) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{name}: {size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise CheckpointError(f"{name}: not a safetensors file, or truncated: its header "
                                  "length does not fit the file")
        header = parse_json(f.read(length), f"{name} (safetensors header)")
    if not isinstance(header, dict):
        raise CheckpointError(f"{name}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{name}: __metadata__ must map names to strings")
    data_start = 8 + length
    tensors = {key: _tensor_info(name, path, key, entry, data_start)
               for key, entry in header.items()}
    offset = data_start
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if info.start != offset:
            raise CheckpointError(f"{name}: invalid offsets: {info.name} starts at byte "
                                  f"{info.start - data_start} of the data, where the previous "
                                  f"tensor ended at {offset - data_start} (a gap or an overlap)")
        offset = info.end
    if offset != size:
        problem = "truncated" if offset > size else "corrupt"
        raise CheckpointError(f"{name}: {problem}: its header declares {offset} bytes, the "
                              f"file has {size}")
    return tensors, metadata


def _tensor_info(file: str, path: Path, key: str, entry: Any, data_start: int) -> TensorInfo:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{file}: tensor {key[:200]!r}: {why}")

    if not isinstance(entry, dict):
        raise bad("its header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise bad("unknown dtype")
    if not isinstance(shape, list) or not all(_natural(n) for n in shape):
        raise bad("shape must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_natural, offsets))
            and offsets[0] <= offsets[1]):
        raise bad("data_offsets must be two non-negative integers, begin <= end")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
        raise bad(f"shape {shape} of {dtype} needs {bits / 8:g} bytes, its data_offsets "
                  f"span {offsets[1] - offsets[0]}")
    return TensorInfo(key, path, dtype, tuple(shape), data_start + offsets[0],
                      data_start + offsets[1])


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def weight_files(folder: Path) -> list[str]:
    """Names of the safetensors files a loader would read: the index's, or every file
    present (regular files only; anything else is a finding, not a wait)."""
    folder = Path(folder)
    if not (folder / INDEX_NAME).exists():
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder} has no .safetensors files")
        return files
    index = read_json(folder, INDEX_NAME, what="safetensors index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{INDEX_NAME}: not a valid index (it needs a weight_map of "
                              "tensor names to file names)")
    files = []
    for name in sorted(set(weight_map.values())):
        # Lexical check first; open_file then checks where links really lead.
        if Path(name).is_absolute() or os.path.normpath(name).startswith(".."):
            raise CheckpointError(f"{INDEX_NAME} points outside the checkpoint folder: "
                                  f"{name[:200]}")
        if not (folder / name).exists():
            raise CheckpointError(f"{INDEX_NAME} points to a missing file: {name[:200]}")
        files.append(os.path.normpath(name))
    return files


def tensor_index(folder: Path) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint, from the headers only."""
    index: dict[str, TensorInfo] = {}
    for name in weight_files(folder):
        for key, info in file_tensors(folder, name).items():
            if key in index:
                raise CheckpointError(f"tensor {key[:200]} is in both {index[key].file.name} "
                                      f"and {name}")
            index[key] = info
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
    count = math.prod(info.shape)
    if values.size != count:
        raise CheckpointError(f"{info.name}: {values.size} values stored, shape {info.shape} "
                              f"needs {count}")
    return values.reshape(info.shape)


def copy_tensors(folder: Path, name: str, dst: Path, drop: set[str]) -> None:
    """Write `folder/name` to `dst` without the tensors in `drop`; every kept tensor's bytes
    are unchanged."""
    tensors, metadata = read_header(folder, name)
    kept = sorted((v for k, v in tensors.items() if k not in drop), key=lambda i: i.start)
    with open_file(folder, name) as fin, open(dst, "wb") as fout:
        fout.write(safetensors_header([(i.name, i.dtype, i.shape, i.end - i.start)
                                       for i in kept], metadata))
        for info in kept:
            fin.seek(info.start)
            remaining = info.end - info.start
            while remaining:
                chunk = fin.read(min(remaining, 64 * 2**20))
                fout.write(chunk)
                remaining -= len(chunk)


def write_tensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """A safetensors file of name -> (dtype, shape, little-endian bytes); numpy, which
    safetensors.numpy goes through, has no bfloat16."""
    with open(path, "wb") as f:
        f.write(safetensors_header([(name, dtype, shape, len(raw))
                                    for name, (dtype, shape, raw) in tensors.items()],
                                   {"format": "pt"}))
        for _, _, raw in tensors.values():
            f.write(raw)


def safetensors_header(tensors: list[tuple[str, str, tuple[int, ...], int]],
                       metadata: dict[str, str] | None) -> bytes:
    """The length-prefixed header of (name, dtype, shape, bytes) laid out in this order."""
    header: dict[str, Any] = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, size in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(blob)) + blob


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
    (missing ones are created when the output is written)."""
    for existing in [folder, *Path(os.path.abspath(folder)).parents]:
        if existing.exists():
            if not existing.is_dir():
                raise UsageError(f"{option} {path}: {existing} is a file, not a folder")
            if not os.access(existing, os.W_OK | os.X_OK):
                raise UsageError(f"{option} {path}: cannot write in {existing}")
            return


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
