"""safetensors without loading weights: headers validated as the format's spec says, the
tensor index of a checkpoint folder, single tensors read as numpy, and files written tensor
by tensor. Only numpy is needed, so that static checks stay fast on checkpoints of any size.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvcalib.dtypes import BY_TORCH_NAME, DTYPES, FP8_BITS
from kvcalib.errors import CheckpointError
from kvcalib.reads import open_file, parse_json, read_json
from kvcalib.writes import new_file

INDEX_NAME = "model.safetensors.index.json"
LONE_NAME = "model.safetensors"  # an unsharded checkpoint; transformers prefers it
# safetensors' own limit (MAX_HEADER_SIZE); a 1 TB model's header is a few MB.
MAX_HEADER_BYTES = 100_000_000
RawTensor = tuple[str, tuple[int, ...], bytes]
# How a git-LFS pointer file begins (a clone without git-lfs leaves these for the shards).
LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # dtype, shape, little-endian bytes


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes sit, from the file's header."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


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
        if head.startswith(LFS_POINTER[:8]) and f.read(len(LFS_POINTER) - 8) == LFS_POINTER[8:]:
            raise CheckpointError(f"{name}: a git-LFS pointer file ({size} bytes), not the "
                                  "weights: the download fetched the pointer only (run "
                                  "`git lfs pull`, or download with huggingface_hub)")
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
    if dtype not in DTYPES:
        raise bad("unknown dtype")
    if not isinstance(shape, list) or not all(_natural(n) for n in shape):
        raise bad("shape must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_natural, offsets))
            and offsets[0] <= offsets[1]):
        raise bad("data_offsets must be two non-negative integers, begin <= end")
    bits = math.prod(shape) * DTYPES[dtype].bits
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


def tensor_index(folder: Path, files: list[str] | None = None) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint (in `files`, default: its weight files), from the
    headers only. With an index, each tensor it names must be in the file it names, and
    each file's tensors must be in the index: loaders look a tensor up in the index, so a
    header that disagrees loses weights."""
    index: dict[str, TensorInfo] = {}
    for name in weight_files(folder) if files is None else files:
        for key, info in file_tensors(folder, name).items():
            if key in index:
                raise CheckpointError(f"tensor {key[:200]} is in both {index[key].file.name} "
                                      f"and {name}")
            index[key] = info
    if (Path(folder) / INDEX_NAME).exists():
        _check_index(folder, index)
    return index


def _check_index(folder: Path, tensors: dict[str, TensorInfo]) -> None:
    weight_map = read_json(folder, INDEX_NAME, what="safetensors index")["weight_map"]
    wrong = sorted(f"{key[:200]} (in {os.path.normpath(name)[:200]})"
                   for key, name in weight_map.items()
                   if key not in tensors or tensors[key].file != Path(folder) / os.path.normpath(
                       name))
    if wrong:
        raise CheckpointError(f"{INDEX_NAME} names {len(wrong)} tensors that are not in the "
                              f"file it names: {', '.join(wrong[:8])}"
                              + (f" and {len(wrong) - 8} more" if len(wrong) > 8 else ""))
    unindexed = sorted(set(tensors) - set(weight_map))
    if unindexed:
        raise CheckpointError(f"{len(unindexed)} tensors are in the shards but not in "
                              f"{INDEX_NAME}, so loaders never read them: "
                              f"{', '.join(n[:200] for n in unindexed[:8])}")


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


def read_raw(info: TensorInfo) -> RawTensor:
    """One tensor as stored, as write_tensors takes it; reads only its bytes."""
    with open(info.file, "rb", buffering=0) as f:
        f.seek(info.start)
        return info.dtype, info.shape, f.read(info.end - info.start)


def read_tensor(info: TensorInfo) -> np.ndarray:
    """One tensor's values as float64 (or its integer type); reads only its bytes."""
    _, _, raw = read_raw(info)
    values = decode(raw, info.dtype, info.name)
    count = math.prod(info.shape)
    if values.size != count:
        raise CheckpointError(f"{info.name}: {values.size} values stored, shape {info.shape} "
                              f"needs {count}")
    return values.reshape(info.shape)


def decode(raw: bytes, dtype: str, name: str = "tensor") -> np.ndarray:
    """Little-endian bytes of a safetensors dtype as float64 (integers keep their type)."""
    if dtype == "BF16":
        bits = np.frombuffer(raw, "<u2").astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)
    if dtype in FP8_BITS:
        return _fp8_table(*FP8_BITS[dtype])[np.frombuffer(raw, "u1")]
    numpy_type = DTYPES[dtype].numpy if dtype in DTYPES else None
    if numpy_type is None:
        raise CheckpointError(f"{name}: unsupported dtype {dtype}")
    values = np.frombuffer(raw, numpy_type)
    return values.astype(np.float64) if values.dtype.kind == "f" else values


def copy_tensors(folder: Path, name: str, dst: Path, drop: set[str]) -> None:
    """Write `folder/name` to `dst` without the tensors in `drop`; every kept tensor's bytes
    are unchanged. `dst` must be a new name (see files.new_file)."""
    tensors, metadata = read_header(folder, name)
    kept = sorted((v for k, v in tensors.items() if k not in drop), key=lambda i: i.start)
    with open_file(folder, name) as fin, new_file(dst) as fout:
        fout.write(safetensors_header([(i.name, i.dtype, i.shape, i.end - i.start)
                                       for i in kept], metadata))
        for info in kept:
            fin.seek(info.start)
            remaining = info.end - info.start
            while remaining:
                chunk = fin.read(min(remaining, 64 * 2**20))
                fout.write(chunk)
                remaining -= len(chunk)


def write_tensors(path: Path, tensors: dict[str, RawTensor]) -> None:
    """A safetensors file of name -> (dtype, shape, little-endian bytes), laid out by name as
    safetensors.torch.save_file lays out tensors of one dtype, byte for byte; numpy, which
    safetensors.numpy goes through, has no bfloat16. `path` must be a new name."""
    ordered = sorted(tensors.items())
    with new_file(path) as f:
        f.write(safetensors_header([(name, dtype, shape, len(raw))
                                    for name, (dtype, shape, raw) in ordered], {"format": "pt"}))
        for _, (_, _, raw) in ordered:
            f.write(raw)


def raw(tensor: Any) -> RawTensor:
    """A torch tensor as write_tensors takes it."""
    import torch

    dtype = BY_TORCH_NAME[str(tensor.dtype).removeprefix("torch.")].name
    return dtype, tuple(tensor.shape), tensor.contiguous().view(torch.uint8).numpy().tobytes()


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
