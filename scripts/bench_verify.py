#!/usr/bin/env python3
"""Benchmark: static `verify` on a checkpoint shaped like a 70B model.

    .venv/bin/python scripts/bench_verify.py [--keep DIR]

Builds Llama-3-70B's layout (80 layers, 64 heads, 8 KV heads, head_dim 128, bf16,
30 weight shards, ~141 GB of declared tensors) as sparse files: real safetensors
headers, holes for the weights, and real per-KV-head scales. Then it measures the static
check (reads headers and scale tensors only): wall time in this process, bytes read
(from /proc/self/io, independent of kvcalib's code), and the wall time of the whole
`kvcalib verify --static-only` command. Targets: under 2 s and under 1 MB read.
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 80, 8192, 64, 8, 128
INTERMEDIATE, VOCAB, SHARDS = 28672, 128256, 30
KVCALIB = Path(sys.executable).parent / "kvcalib"


def _layer_tensors(i: int) -> dict[str, tuple[int, ...]]:
    p = f"model.layers.{i}"
    return {f"{p}.input_layernorm.weight": (HIDDEN,),
            f"{p}.post_attention_layernorm.weight": (HIDDEN,),
            f"{p}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{p}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"{p}.mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            f"{p}.mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            f"{p}.mlp.down_proj.weight": (HIDDEN, INTERMEDIATE)}


def _write_sparse_shard(path: Path, shapes: dict[str, tuple[int, ...]]) -> int:
    """A valid safetensors file whose tensor data is a hole; returns the declared bytes."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset,
                                                                                offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return offset


def build(folder: Path) -> int:
    """Write the sparse 70B-shaped checkpoint into `folder`; returns declared weight bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
               "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        tensors.update(_layer_tensors(i))
    names = list(tensors)
    weight_map, declared = {}, 0
    for s, chunk in enumerate(np.array_split(np.arange(len(names)), SHARDS)):
        file = f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors"
        shard = {names[j]: tensors[names[j]] for j in chunk}
        declared += _write_sparse_shard(folder / file, shard)
        weight_map.update(dict.fromkeys(shard, file))
    _write_scales(folder, weight_map)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": declared}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head",
                                "dynamic": False, "symmetric": True}}}))
    return declared


def _write_scales(folder: Path, weight_map: dict[str, str]) -> None:
    rng = np.random.default_rng(0)
    header, data = {}, b""
    for i in range(LAYERS):
        for kind in "kv":
            values = (rng.uniform(0.005, 0.05, KV_HEADS).astype(np.float32).view(np.uint32)
                      >> 16).astype("<u2").tobytes()  # bf16 by truncation
            name = f"model.layers.{i}.self_attn.{kind}_scale"
            header[name] = {"dtype": "BF16", "shape": [KV_HEADS, 1, 1],
                            "data_offsets": [len(data), len(data) + len(values)]}
            data += values
            weight_map[name] = "kv_scales.safetensors"
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    (folder / "kv_scales.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def bytes_read() -> int:
    """Bytes this process has read through read() calls so far (Linux /proc/self/io)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def measure(folder: Path) -> dict[str, float]:
    """Static check of `folder` in this process: seconds, bytes read, checks and failures.

    Measured on the second check: the first imports torch and transformers' model classes
    lazily, and reading their modules (60-130 MB on a fresh environment) would count as
    reading the checkpoint. The process-level cost is the command's wall time below."""
    from kvcalib.checkpoint import open_checkpoint

    open_checkpoint(folder)
    started_bytes, started = bytes_read(), time.perf_counter()
    _, checks = open_checkpoint(folder)
    seconds = time.perf_counter() - started
    read = bytes_read() - started_bytes
    return {"seconds": seconds, "bytes_read": read, "checks": len(checks),
            "failed": sum(c.status != "pass" for c in checks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=Path, help="build the checkpoint here and keep it")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp) / "llama-70b-shaped"
        declared = build(folder)
        on_disk = sum(p.stat().st_blocks * 512 for p in folder.iterdir())
        result = measure(folder)
        started = time.perf_counter()
        cli = subprocess.run([str(KVCALIB), "verify", str(folder), "--static-only"],
                             capture_output=True, text=True)
        cli_seconds = time.perf_counter() - started
    print(f"70B-shaped checkpoint: {LAYERS} layers, {SHARDS} shards, "
          f"{declared / 1e9:.1f} GB declared, {on_disk / 1e6:.1f} MB on disk")
    print(f"static verify in-process: {result['seconds']:.3f} s, "
          f"{result['bytes_read'] / 1e3:.1f} kB read ({result['bytes_read'] / declared:.2e} of "
          f"the declared bytes), {result['checks']} checks, {result['failed']} not passed")
    print(f"kvcalib verify --static-only (whole command): {cli_seconds:.2f} s, exit "
          f"{cli.returncode}")


if __name__ == "__main__":
    main()
