"""What an FP8 KV cache buys and costs in serving: latency, throughput and useful
concurrency, measured by vLLM's own `vllm bench serve` against a local `vllm serve`.

The weights stay fixed; only the KV cache changes. For each cache (`auto`, served as the
model dtype by name since vLLM resolves `auto` to fp8 for a checkpoint with a
kv_cache_scheme, and `fp8` with the checkpoint's scales) one server starts on 127.0.0.1 with the
same max_model_len and, with --kv-budget, the same KV memory. vLLM's benchmark then runs
the same workload (random prompts of --input-len tokens, --output-len generated with EOS
ignored, --num-prompts requests) at each --concurrency, --repeats times. Every number is
read from vLLM's result file or its /metrics endpoint; kvcalib only takes medians and
ranges over the repeats, and picks the largest concurrency that meets the latency targets.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcalib.bench.options import BenchOptions
from kvcalib.bench.result import METRICS, BenchResult, CacheRun, spread, useful_concurrency
from kvcalib.engine.interpreter import FP8_KV_UNSUPPORTED, fp8_kv_supported, serving_checkpoint
from kvcalib.engine.log import parse_log
from kvcalib.engine.process import SCRIPTS
from kvcalib.engine.server import ServerFailed, serve
from kvcalib.kvcache import geometry
from kvcalib.kvcache.capacity import parse_budget
from kvcalib.reads import load_config

BENCH = SCRIPTS / "vllm_bench.py"
PREEMPTIONS = "vllm:num_preemptions_total"  # the server's Prometheus counter


def bench(checkpoint: str | Path, options: BenchOptions, log_dir: Path,
          log: Callable[[str], None]) -> BenchResult:
    """Start one server per cache and run vLLM's benchmark at every concurrency."""
    folder, python = serving_checkpoint(checkpoint, options.vllm_python)
    config = load_config(folder)
    caches = []
    for dtype in options.kv_cache_dtypes:
        if dtype.startswith("fp8") and not fp8_kv_supported(python):
            caches.append(CacheRun(dtype, False, FP8_KV_UNSUPPORTED))
            log(f"{dtype}: skipped, {caches[-1].reason}")
            continue
        served = geometry.served_cache_dtype(dtype, config)
        caches.append(_measure(python, folder, dtype, served, options, log_dir, log))
    workload = {k: getattr(options, k) for k in ("input_len", "output_len", "num_prompts",
                                                 "concurrency", "repeats", "kv_budget",
                                                 "max_model_len", "seed",
                                                 "enforce_eager")}
    return BenchResult(str(checkpoint), workload, {"max_ttft_ms": options.max_ttft_ms,
                                                   "max_tpot_ms": options.max_tpot_ms},
                       caches, python)


def _measure(python: str, folder: Path, dtype: str, served: str, options: BenchOptions,
             log_dir: Path, log: Callable[[str], None]) -> CacheRun:
    log_path = log_dir / f"vllm-serve-{dtype}.log"
    log(f"Starting vllm serve with kv_cache_dtype={served}; log: {log_path}")
    try:
        with serve(python, folder, _server_args(served, options), log_path,
                   options.timeout) as url:
            facts = parse_log(log_path.read_text(errors="replace"))
            run = CacheRun(dtype, True, served_as=served, capacity=facts.capacity,
                           log=str(log_path))
            for concurrency in options.concurrency:
                repeats = []
                for repeat in range(options.repeats):
                    log(f"{dtype}: concurrency {concurrency}, repeat {repeat + 1} of "
                        f"{options.repeats}")
                    before = _preemptions(url)
                    result = _bench_serve(python, url, folder, options, concurrency,
                                          log_dir / f"bench-{dtype}-c{concurrency}-r{repeat}.json")
                    result["preemptions"] = _preemptions(url) - before
                    repeats.append(result)
                run.rows.append(_row(concurrency, repeats, options.num_prompts))
    except ServerFailed as failed:
        return CacheRun(dtype, False, str(failed), served_as=served, log=str(log_path))
    run.useful_concurrency = useful_concurrency(run.rows, options.max_ttft_ms,
                                                options.max_tpot_ms)
    return run


def _server_args(dtype: str, options: BenchOptions) -> list[str]:
    """`vllm serve`'s arguments for one cache: the same length, seed and KV budget for all."""
    return ["--kv-cache-dtype", dtype, "--max-model-len", str(options.max_model_len),
            "--seed", str(options.seed),
            "--kv-cache-memory-bytes", str(parse_budget(options.kv_budget)),
            *(["--enforce-eager"] if options.enforce_eager else [])]


def _row(concurrency: int, repeats: list[dict[str, Any]], num_prompts: int) -> dict[str, Any]:
    """One concurrency: each metric's median and range over the repeats."""
    failed = [r["completed"] for r in repeats if r["completed"] != num_prompts]
    if failed:
        raise ServerFailed(f"vLLM's benchmark completed {failed[0]} of {num_prompts} "
                           f"requests at concurrency {concurrency}")
    row: dict[str, Any] = {"concurrency": concurrency}
    for key in (*METRICS, "preemptions"):
        row[key] = spread([float(r[key]) for r in repeats])
    return row


def _preemptions(url: str) -> float:
    """The server's preemption counter, from its Prometheus metrics."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as answer:
            text = answer.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        raise ServerFailed(f"vllm serve's /metrics did not answer: {exc}") from None
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(PREEMPTIONS))


def _bench_serve(python: str, url: str, folder: Path, options: BenchOptions,
                 concurrency: int, result_path: Path) -> dict[str, Any]:
    """vLLM's `bench serve` once; its result file, kept beside the server logs."""
    command = [python, str(BENCH), "--backend", "vllm", "--base-url", url,
               "--model", str(folder), "--dataset-name", "random",
               "--random-input-len", str(options.input_len),
               "--random-output-len", str(options.output_len),
               "--num-prompts", str(options.num_prompts), "--max-concurrency", str(concurrency),
               "--ignore-eos", "--seed", str(options.seed), "--disable-tqdm",
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", str(result_path.parent),
               "--result-filename", result_path.name]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tempfile.gettempdir(),
                          timeout=options.timeout)
    if done.returncode != 0 or not result_path.is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ServerFailed(f"vLLM's bench serve exited with code {done.returncode}: {last}")
    return json.loads(result_path.read_text())
