#!/usr/bin/env python3
"""Does `kvcalib verify` give the same verdict every time on one checkpoint?

    .venv/bin/python scripts/verify_repeat.py CKPT --runs 5 [--kv-cache-dtype fp8]
        [--max-model-len 2048] [--log-dir DIR]

Runs the whole `kvcalib verify` command (static checks and a fresh vLLM engine) N times,
as a release pipeline would, and prints each run's verdict, time and notes, then the
agreement, e.g. "5/5 PASS". A gate whose verdict changes from run to run on the same
input (vLLM's shutdown noise once did that) gets switched off.

Exit code: 0 when every run gave the same verdict, 1 when they disagree, 2 on bad usage.
Every run's JSON report and engine log stay under --log-dir (default:
./verify-repeat-logs/NAME/run-I) for comparing runs that disagree.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

KVCALIB = Path(sys.executable).parent / "kvcalib"
VERDICTS = {0: "PASS", 1: "FAIL", 2: "ERROR"}


def run_once(ckpt: Path, out: Path, kv_cache_dtype: str, max_model_len: int) -> dict:
    """One `kvcalib verify`: its verdict, wall time, and what it found."""
    started = time.perf_counter()
    done = subprocess.run([str(KVCALIB), "verify", str(ckpt), "--json", str(out / "verify.json"),
                           "--kv-cache-dtype", kv_cache_dtype, "--max-model-len",
                           str(max_model_len)], capture_output=True, text=True)
    seconds = time.perf_counter() - started
    report = out / "verify.json"
    if not report.exists():  # a usage error: its one line says why
        return {"verdict": VERDICTS.get(done.returncode, f"exit {done.returncode}"),
                "seconds": seconds, "problems": done.stderr.splitlines()[-1:], "notes": []}
    checks = json.loads(report.read_text())["checks"]
    return {"verdict": VERDICTS.get(done.returncode, f"exit {done.returncode}"),
            "seconds": seconds,
            "problems": [c["message"].splitlines()[0] for c in checks
                         if c["status"] in ("fail", "error")],
            "notes": [c["message"].splitlines()[0] for c in checks if c["group"] == "note"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--kv-cache-dtype", default="fp8")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--log-dir", type=Path)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if not args.checkpoint.is_dir():
        parser.error(f"checkpoint folder not found: {args.checkpoint}")
    log_dir = args.log_dir or Path("verify-repeat-logs") / args.checkpoint.resolve().name
    results = []
    for index in range(1, args.runs + 1):
        out = log_dir / f"run-{index}"
        out.mkdir(parents=True, exist_ok=True)
        result = run_once(args.checkpoint, out, args.kv_cache_dtype, args.max_model_len)
        results.append(result)
        print(f"run {index}/{args.runs}: {result['verdict']} in {result['seconds']:.1f} s"
              + "".join(f"\n  problem: {p}" for p in result["problems"])
              + "".join(f"\n  note: {n}" for n in result["notes"]), flush=True)
    seconds = [r["seconds"] for r in results]
    counts = collections.Counter(r["verdict"] for r in results)
    print(f"wall time per run: median {statistics.median(seconds):.1f} s "
          f"(min {min(seconds):.1f}, max {max(seconds):.1f}); runs with notes: "
          f"{sum(bool(r['notes']) for r in results)}/{args.runs}; logs: {log_dir}")
    agreement = ", ".join(f"{n}/{args.runs} {verdict}" for verdict, n in counts.most_common())
    print(f"Verdicts: {agreement}" + ("" if len(counts) == 1 else " (DISAGREE)"))
    return 0 if len(counts) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
