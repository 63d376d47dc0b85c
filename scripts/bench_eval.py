#!/usr/bin/env python3
"""Benchmark: the cost of simulating an FP8 KV cache, against plain forward passes.

    .venv/bin/python scripts/bench_eval.py [--num-samples 8] [--max-seq-len 512]

On SmolLM2-135M calibrated by kvcalib (built-in corpus), with the same token ids:
- plain forward: the model as transformers loads it, no simulation;
- simulated forward: the same model routed through kvcalib's simulated cache, FP8 with
  the checkpoint's scales (fake-quantizing every layer's K and V);
- the per-layer sweep (each layer alone, all but each layer: 2L + 1 passes), timed.
Target: simulated / plain at most 1.5.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from kvcalib import quantsim
from kvcalib.calibration import calibrate
from kvcalib.data import DatasetSpec, select_samples
from kvcalib.demo_model import prepare_demo_model
from kvcalib.evaluation import batches, load_model, scales_of, sweep
from kvcalib.verification import static_checks


def forward_seconds(model, batch_list, simulation) -> float:
    with torch.no_grad(), quantsim.simulate(simulation):
        model(*batch_list[0][:1])  # warm-up
        started = time.perf_counter()
        for tokens, mask in batch_list:
            model(tokens, attention_mask=mask)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--sweep-samples", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = calibrate(prepare_demo_model(), Path(tmp) / "ckpt", strategy="attn_head",
                         dataset=DatasetSpec("builtin"), num_samples=8, max_seq_len=256,
                         log=lambda _: None).output
        model, tokenizer = load_model(ckpt, "float32")
        samples = select_samples(DatasetSpec("builtin"), tokenizer, args.num_samples,
                                 args.max_seq_len, seed=1)
        batch_list = list(batches(samples, 1, 0))
        _, found = static_checks(ckpt)
        simulation = quantsim.Simulation(scales=scales_of(found))
        # The baseline is the model as transformers loads it, without kvcalib's routing.
        untouched = AutoModelForCausalLM.from_pretrained(prepare_demo_model(),
                                                         dtype=torch.float32).eval()
        plain = forward_seconds(untouched, batch_list, None)
        simulated = forward_seconds(model, batch_list, simulation)
        layers = found.geometry.attention_layers
        started = time.perf_counter()
        sweep(model, batch_list[:args.sweep_samples], simulation, layers, None, lambda: None)
        sweep_seconds = time.perf_counter() - started
    print(f"SmolLM2-135M, {len(batch_list)} samples, {samples.num_tokens} tokens, float32, "
          f"torch threads {torch.get_num_threads()}", file=sys.stderr)
    print(f"plain forward:          {plain:7.2f} s")
    print(f"simulated FP8 forward:  {simulated:7.2f} s  ratio {simulated / plain:.3f} "
          "(target <= 1.5)")
    passes = 2 * len(layers) + 1
    print(f"per-layer sweep:        {sweep_seconds:7.2f} s  ({passes} configurations + the "
          f"reference, {args.sweep_samples} sample(s) of <= {args.max_seq_len} tokens)")


if __name__ == "__main__":
    main()
