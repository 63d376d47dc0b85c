#!/usr/bin/env python3
"""How much `run --attention sdpa` moves the scales against the default eager attention.

    .venv/bin/python scripts/attention_scales.py [--seeds 0,1,2] [--num-samples 4]
        [--max-seq-len 512] [--dir DIR]

Calibrates SmolLM2-135M (the demo model, attn_head, builtin corpus) under eager and sdpa
attention, computing in float32 and in bfloat16, once per seed (each seed draws other
samples). Per dtype it prints how many stored scales differ between the two attentions
and by how much, and, for bfloat16, how far each attention's scales are from the float32
ones of the same samples (the rounding both inherit from computing in bf16). Median and
range over the seeds. bf16 runs ~7x slower on CPUs without native bf16.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvcalib.calibrate import (
    ComputeOptions,
    SampleOptions,
    ScaleOptions,
    WriteOptions,
    calibrate,
)
from kvcalib.data import DatasetSpec
from kvcalib.demo import prepare_demo_model
from kvcalib.tables import table


def scales(model: Path, out: Path, seed: int, dtype: str, attention: str,
           args: argparse.Namespace) -> torch.Tensor:
    """Every stored k/v scale of one calibration, flattened in name order, as float32."""
    calibrate(model, out, scales=ScaleOptions(strategy="attn_head"),
              samples=SampleOptions(DatasetSpec("builtin"), args.num_samples, args.max_seq_len,
                                    seed),
              compute=ComputeOptions("basic", dtype, attention),
              writing=WriteOptions("link", overwrite=True), log=lambda _: None)
    stored = load_file(out / "kv_scales.safetensors")
    return torch.cat([stored[name].float().flatten() for name in sorted(stored)])


def spread(values: list[float], fmt: str = ".2e") -> str:
    return (f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--num-samples", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    model = prepare_demo_model()
    seeds = [int(seed) for seed in args.seeds.split(",")]
    rows: dict[str, list[list[float]]] = {"float32": [], "bfloat16": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for seed in seeds:
            got = {(dtype, attention): scales(model, Path(tmp) / f"{dtype}-{attention}", seed,
                                              dtype, attention, args)
                   for dtype in rows for attention in ("eager", "sdpa")}
            exact = got[("float32", "eager")]
            for dtype in rows:
                eager, sdpa = got[(dtype, "eager")], got[(dtype, "sdpa")]
                moved = (eager - sdpa).abs() / eager
                rows[dtype].append([float((moved > 0).float().mean()), float(moved.max()),
                                    float(((eager - exact).abs() / exact).mean()),
                                    float(((sdpa - exact).abs() / exact).mean())])
                print(f"  seed {seed}, {dtype}: {rows[dtype][-1]}", flush=True)
    print(f"\nSmolLM2-135M, attn_head, {args.num_samples} samples x {args.max_seq_len} tokens, "
          f"{len(exact)} k/v scales, seeds {args.seeds} (median, range)")
    print(table(["compute dtype", "scales differing", "largest change",
                 "eager vs fp32 (mean rel.)", "sdpa vs fp32 (mean rel.)"],
                [[dtype, spread([r[0] for r in values], ".1%"),
                  spread([r[1] for r in values], ".1%"),
                  spread([r[2] for r in values]), spread([r[3] for r in values])]
                 for dtype, values in rows.items()]))


if __name__ == "__main__":
    main()
