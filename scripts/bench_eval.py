#!/usr/bin/env python3
"""Benchmark: the cost of simulating each KV cache format, against plain forward passes.

    .venv/bin/python scripts/bench_eval.py [--num-samples 8] [--max-seq-len 512] [--repeats 3]

On SmolLM2-135M calibrated by kvcalib (built-in corpus), with the same token ids:
- plain forward: the model as transformers loads it, no simulation;
- simulated forward: the same model routed through kvcalib's simulated cache, FP8 with
  the checkpoint's scales (fake-quantizing every layer's K and V), then every vLLM format
  (kvcalib.kvcache.formats) on the layers vLLM quantizes; NVFP4 with calibrated global scales
  (absmax / 2688, as ModelOpt) and at 1.0. Timings alternate plain and simulated passes;
  the ratio is best simulated / best plain over --repeats (the least disturbed runs on a
  shared machine), with the range of the per-repeat ratios;
- per format, the relative error ||K̂ - K|| / ||K|| (and for V) over the quantized layers'
  post-RoPE K/V on the same samples: a sanity check of the simulations;
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
from transformers import AutoModelForCausalLM, DynamicCache

from kvcalib.calibrate import SampleOptions, ScaleOptions, calibrate
from kvcalib.checkpoint import open_checkpoint
from kvcalib.data import DatasetSpec, select_samples
from kvcalib.demo import prepare_demo_model
from kvcalib.evaluate.metrics import batches
from kvcalib.evaluate.run import load_model
from kvcalib.evaluate.sweep import sweep
from kvcalib.kvcache import formats as kvformats
from kvcalib.kvcache import quantize
from kvcalib.kvcache import simulate as quantsim


def forward_seconds(model, batch_list, simulation) -> float:
    with torch.no_grad(), quantsim.simulate(simulation):
        model(*batch_list[0][:1])  # warm-up
        started = time.perf_counter()
        for tokens, mask in batch_list:
            model(tokens, attention_mask=mask)
    return time.perf_counter() - started


def format_simulations(scales, layers: list[int], num_layers: int
                       ) -> dict[str, quantsim.Simulation]:
    """Every quantized vLLM format on the layers it quantizes; static scales from the
    checkpoint (NVFP4: the matching global scales, and 1.0)."""
    nvfp4 = {layer: {kind: torch.tensor(kvformats.nvfp4_global_scale(
        float(value.max()) * 448.0)) for kind, value in kinds.items() if kind in "kv"}
        for layer, kinds in scales.items()}
    sims = {}
    for name, fmt in kvformats.FORMATS.items():
        if not fmt.quantized or name == "fp8_e4m3":  # fp8_e4m3 is fp8
            continue
        own = {"fp8": scales, "nvfp4": nvfp4}.get(fmt.static_scales, {})
        quantized = kvformats.quantized_layers(fmt, layers, num_layers)
        label = f"{name} (calibrated)" if own else name
        sims[label] = quantsim.Simulation(format=fmt, scales=own, layers=quantized,
                                          count_clipping=False)
        if fmt.static_scales == "nvfp4":
            sims[f"{name} (scale 1.0)"] = quantsim.Simulation(format=fmt, layers=quantized)
    return sims


@torch.no_grad()
def relative_errors(model, batch_list, sim: quantsim.Simulation) -> tuple[float, float]:
    """||K̂ - K|| / ||K|| and the same for V, over the simulation's layers and all tokens."""
    fmt = sim.format
    squared = {"k": [0.0, 0.0], "v": [0.0, 0.0]}
    for tokens, mask in batch_list:
        cache = DynamicCache()
        model(tokens, attention_mask=mask, past_key_values=cache, use_cache=True)
        for layer, entry in enumerate(cache.layers):
            if layer not in sim.layers:
                continue
            for kind, states in (("k", entry.keys), ("v", entry.values)):
                if fmt.fp8:
                    out = quantsim.fake_quantize(states, sim.scale(layer, kind), fmt.fp8)
                else:
                    how = fmt.keys if kind == "k" else fmt.values
                    out = quantize.apply(how, states, sim.scale(layer, kind))
                squared[kind][0] += float(((out.float() - states.float()) ** 2).sum())
                squared[kind][1] += float((states.float() ** 2).sum())
    return tuple((error / total) ** 0.5 for error, total in squared.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=8)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--sweep-samples", type=int, default=2)  # intervals need 2
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = calibrate(prepare_demo_model(), Path(tmp) / "ckpt",
                         scales=ScaleOptions(strategy="attn_head"),
                         samples=SampleOptions(DatasetSpec("builtin"), 8, 256),
                         log=lambda _: None).output
        opened, _ = open_checkpoint(ckpt)
        model, tokenizer = load_model(opened, "float32")
        samples = select_samples(DatasetSpec("builtin"), tokenizer, args.num_samples,
                                 args.max_seq_len, seed=1)
        batch_list = list(batches(samples, 1, 0))
        simulation = quantsim.Simulation(scales=opened.scales.to_torch())
        # The baseline is the model as transformers loads it, without kvcalib's routing.
        untouched = AutoModelForCausalLM.from_pretrained(prepare_demo_model(),
                                                         dtype=torch.float32).eval()
        plain = forward_seconds(untouched, batch_list, None)
        simulated = forward_seconds(model, batch_list, simulation)
        layers = opened.geometry.attention_layers
        sims = format_simulations(simulation.scales, layers, opened.geometry.num_layers)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in sims}
        for _ in range(args.repeats):
            for name, sim in sims.items():
                base = forward_seconds(untouched, batch_list, None)
                times[name].append((base, forward_seconds(model, batch_list, sim)))
        errors = {name: relative_errors(untouched, batch_list, sim) for name, sim in sims.items()}
        started = time.perf_counter()
        sweep(model, batch_list[:args.sweep_samples], simulation, layers, None, lambda: None)
        sweep_seconds = time.perf_counter() - started
    print(f"SmolLM2-135M, {len(batch_list)} samples, {samples.num_tokens} tokens, float32, "
          f"torch threads {torch.get_num_threads()}", file=sys.stderr)
    print(f"plain forward:          {plain:7.2f} s")
    print(f"simulated FP8 forward:  {simulated:7.2f} s  ratio {simulated / plain:.3f} "
          "(target <= 1.5)")
    print(f"\nper format (best of {args.repeats} simulated / best of the plain forwards run "
          "just before them, [range of the per-repeat ratios]; relative K/V error on the "
          "quantized layers):")
    for name, pairs in times.items():
        k_error, v_error = errors[name]
        each = [sim / base for base, sim in pairs]
        best = min(sim for _, sim in pairs) / min(base for base, _ in pairs)
        print(f"  {name:34s} ratio {best:.3f} [{min(each):.3f}-{max(each):.3f}]  "
              f"K err {k_error:.4f}  V err {v_error:.4f}")
    passes = 2 * len(layers) + 1
    print(f"\nper-layer sweep:        {sweep_seconds:7.2f} s  ({passes} configurations + the "
          f"reference, {args.sweep_samples} sample(s) of <= {args.max_seq_len} tokens)")


if __name__ == "__main__":
    main()
