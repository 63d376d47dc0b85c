"""Checkpoints rebuilt from tests/fixtures/peers: what AMD Quark 0.13 and NVIDIA ModelOpt
0.47 really exported for SmolLM2 (scripts/make_peer_fixtures.py made them).

Each fixture holds the export's config files, its KV scale tensors byte for byte, and a
manifest of every tensor (name, dtype, shape, sha256). `materialize` lays out a checkpoint
folder with every tensor of the manifest: the scales as exported, and the weights either
taken from a model folder that holds the same bytes (checked against the sha256; only the
KV-only exports kept SmolLM2's weights unchanged), or zeros in a sparse file, or random
bytes (to see that a copy keeps them): the right names, dtypes and shapes for static
checks, but not a model.

Reads safetensors by hand (numpy has no bfloat16), independently of kvcalib's reader.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures" / "peers"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "manifest.json").exists())
BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "F8_E4M3": 8, "I8": 8, "U8": 8,
        "I32": 32, "I64": 64}


def manifest(name: str) -> dict:
    return json.loads((FIXTURES / name / "manifest.json").read_text())


def raw_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """name -> (dtype, shape, bytes) of every tensor in a safetensors file."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header.pop("__metadata__", None)
    base = 8 + length
    return {name: (e["dtype"], e["shape"], data[base + e["data_offsets"][0]:
                                                base + e["data_offsets"][1]])
            for name, e in header.items()}


def as_float(dtype: str, raw: bytes) -> np.ndarray:
    """Little-endian F32/F16/BF16 bytes as float64."""
    if dtype == "BF16":
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32).astype(
            np.float64)
    return np.frombuffer(raw, {"F32": "<f4", "F16": "<f2"}[dtype]).astype(np.float64)


def scales(name: str) -> dict[str, float]:
    """The fixture's scale tensors by name, as floats (all are per-tensor here)."""
    return {key: float(as_float(dtype, raw).max())
            for key, (dtype, _, raw) in raw_tensors(FIXTURES / name / "scales.safetensors").items()}


def materialize(name: str, dest: Path, weights_from: Path | None = None,
                drop: tuple[str, ...] = (), fill: str = "zeros") -> Path:
    """A checkpoint folder from fixture `name` (see the module docstring), without the
    tensors in `drop`. With `weights_from`, every weight must match the manifest's sha256;
    without, weights are `fill`: "zeros" or "random"."""
    fixture = FIXTURES / name
    dest.mkdir(parents=True)
    for item in fixture.iterdir():
        if item.suffix == ".json" and item.name != "manifest.json":
            shutil.copyfile(item, dest / item.name)
    exported = raw_tensors(fixture / "scales.safetensors")
    source = _tensor_bytes(weights_from) if weights_from else {}
    entries = []
    rng = np.random.default_rng(0)
    for tensor, dtype, shape, sha in manifest(name)["tensors"]:
        if tensor in drop:
            continue
        raw = exported[tensor][2] if tensor in exported else source.get(tensor)
        if raw is not None and hashlib.sha256(raw).hexdigest() != sha:
            raise ValueError(f"{weights_from}: {tensor} is not the tensor {name} exported")
        if weights_from and raw is None:
            raise ValueError(f"{weights_from} has no tensor {tensor}")
        if raw is None and fill == "random":
            raw = rng.bytes(math.prod(shape) * BITS[dtype] // 8)
        entries.append((tensor, dtype, shape, raw))
    _write(dest / "model.safetensors", entries)
    if weights_from:
        for item in weights_from.iterdir():  # tokenizer and generation config
            if item.suffix in (".json", ".jinja") and not (dest / item.name).exists() and (
                    item.name != "model.safetensors.index.json"):
                shutil.copyfile(item, dest / item.name)
    return dest


def _tensor_bytes(folder: Path) -> dict[str, bytes]:
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        found.update({k: raw for k, (_, _, raw) in raw_tensors(path).items()})
    return found


def _write(path: Path, entries: list[tuple[str, str, list[int], bytes | None]]) -> None:
    """A safetensors file; tensors without bytes are zeros, left as holes in the file."""
    header, offset = {}, 0
    for tensor, dtype, shape, _ in entries:
        size = math.prod(shape) * BITS[dtype] // 8
        header[tensor] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for tensor, _, _, raw in entries:
            begin, end = header[tensor]["data_offsets"]
            if raw is None:
                f.seek(end - begin, 1)
            else:
                f.write(raw)
        f.truncate(8 + len(blob) + offset)
