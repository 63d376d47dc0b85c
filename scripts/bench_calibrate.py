#!/usr/bin/env python3
"""Benchmark: kvcalib's calibration time against a plain forward pass over the same tokens.

    .venv/bin/python scripts/bench_calibrate.py [--num-samples 16] [--max-seq-len 512]

Everything is measured in one run on SmolLM2-135M with the same token ids:
- the plain baseline: `torch.no_grad()` forward passes of the model (transformers'
  default attention, and eager attention, which llm-compressor calibrates under);
- `kvcalib run` with the basic and the sequential pipeline, each in its own process,
  timed by its report ("calibrate": the llm-compressor pass) and measured for peak RSS.
The floor of the ratio is 1.0; the target for the basic pipeline is at most 1.3.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvcalib.data import DatasetSpec, select_samples
from kvcalib.demo_model import prepare_demo_model
from kvcalib.report import table

KVCALIB = Path(sys.executable).parent / "kvcalib"


def forward_seconds(model_dir: Path, token_ids: list[list[int]], dtype: str, attn: str) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                 attn_implementation=attn).eval()
    with torch.no_grad():
        model(torch.tensor([token_ids[0]]))  # warm-up
        started = time.perf_counter()
        for ids in token_ids:
            model(torch.tensor([ids]))
        return time.perf_counter() - started


def run_kvcalib(model_dir: Path, out: Path, args: argparse.Namespace, pipeline: str):
    """(report, peak RSS in bytes) of one `kvcalib run` in its own process."""
    command = [str(KVCALIB), "run", "--model", str(model_dir), "--output", str(out),
               "--dataset", "builtin", "--num-samples", str(args.num_samples),
               "--max-seq-len", str(args.max_seq_len), "--strategy", "attn_head",
               "--pipeline", pipeline, "--json", "-"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    stdout = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"kvcalib run failed: {' '.join(command)}")
    return json.loads(stdout), usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-samples", type=int, default=16)
    parser.add_argument("--max-seq-len", type=int, default=512)
    args = parser.parse_args()

    model_dir = prepare_demo_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = select_samples(DatasetSpec("builtin"), tokenizer, args.num_samples,
                             args.max_seq_len, seed=0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        reports = {}
        for pipeline in ("basic", "sequential"):
            reports[pipeline] = run_kvcalib(model_dir, Path(tmp) / pipeline, args, pipeline)
        basic_report = reports["basic"][0]
        assert basic_report["dataset"]["token_ids_sha256"] == samples.digest(), "other tokens"
        dtype = basic_report["compute"]["dtype"]
        plain = forward_seconds(model_dir, samples.token_ids, dtype, "sdpa")
        eager = forward_seconds(model_dir, samples.token_ids, dtype, "eager")
        rows.append(["plain forward (sdpa)", plain, 1.0, "-"])
        rows.append(["plain forward (eager)", eager, eager / plain, "-"])
        for pipeline, (report, rss) in reports.items():
            seconds = report["timings_s"]["calibrate"]
            rows.append([f"kvcalib calibrate ({pipeline})", seconds, seconds / plain,
                         f"{rss / 2**30:.2f} GiB"])
    print(f"SmolLM2-135M, {len(samples.token_ids)} samples, {samples.num_tokens} tokens, "
          f"{dtype} on {basic_report['compute']['device']}, torch threads "
          f"{torch.get_num_threads()}")
    print(table(["pass", "seconds", "x plain forward", "peak RSS"], rows))


if __name__ == "__main__":
    main()
