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

import contextlib
import json
import os
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcalib.checks import ERROR, FAIL, PASS, SKIP, Check, exit_code
from kvcalib.choices import OptionGroup, option
from kvcalib.errors import UsageError
from kvcalib.files import load_config
from kvcalib.kvcache import geometry
from kvcalib.kvcache.capacity import parse_budget
from kvcalib.verify import engine
from kvcalib.verify.options import vllm_python_option

BENCH = Path(engine.__file__).resolve().parent / "probe" / "vllm_bench.py"
# vLLM's result keys that kvcalib reports (vllm/benchmarks/serve.py, `benchmark`'s result)
METRICS = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "output_throughput",
           "request_throughput")
PREEMPTIONS = "vllm:num_preemptions_total"  # the server's Prometheus counter
ENGINE_FAILED = "EngineCore failed to start"  # vllm/v1/engine/core.py's last word


@dataclass(frozen=True)
class BenchOptions(OptionGroup):
    """The workload, the caches compared, the targets, and how vLLM starts."""

    kv_cache_dtypes: list[str] = option(["auto", "fp8"], "KV caches to compare (vLLM "
                                        "kv_cache_dtype names), comma separated.",
                                        "--kv-cache-dtypes", comma=str)
    input_len: int = option(128, "Prompt tokens per request (random tokens).", low=1)
    output_len: int = option(32, "Generated tokens per request (EOS ignored).", low=1)
    num_prompts: int = option(16, "Requests per measurement.", low=1)
    concurrency: list[int] = option([1, 4], "Concurrent requests, comma separated: one "
                                    "measurement each.", comma=int, low=1)
    repeats: int = option(3, "Measurements per cache and concurrency (their median and "
                          "range are reported).", low=1)
    kv_budget: str = option("1GiB", "KV-cache memory for every cache (16MiB, 1GiB...; vLLM "
                            "--kv-cache-memory-bytes): the same budget, so the smaller cache "
                            "holds more tokens.")
    max_model_len: int = option(2048, "vLLM max_model_len.", low=1)
    max_ttft_ms: float | None = option(None, "Target: p99 time to first token (ms).", low=0)
    max_tpot_ms: float | None = option(None, "Target: p99 time per output token (ms).", low=0)
    seed: int = option(0, "Seed of vLLM's random prompts (the same for every measurement).")
    enforce_eager: bool = option(False, "Serve without torch.compile: starts a minute or two "
                                 "sooner on a CPU, but measures the uncompiled model.",
                                 "--enforce-eager")
    vllm_python: str | None = vllm_python_option()
    timeout: float = option(1200, "Seconds to wait for each server to start.", low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_budget(self.kv_budget)  # refused now, not after a server start
        if self.input_len + self.output_len > self.max_model_len:
            raise UsageError(f"--input-len + --output-len ({self.input_len + self.output_len})"
                             f" exceed --max-model-len {self.max_model_len}")


@dataclass
class CacheRun:
    """One cache: its server's capacity line, and one row per concurrency (or why it did
    not run)."""

    kv_cache_dtype: str
    ran: bool
    reason: str | None = None
    served_as: str | None = None  # what vLLM was given: `auto` is named as the model dtype
    capacity: dict[str, Any] | None = None
    log: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    useful_concurrency: int | None = None

    @property
    def label(self) -> str:
        """'auto (bfloat16)', or the dtype when vLLM was given it by that name."""
        served = self.served_as
        return self.kv_cache_dtype if served in (None, self.kv_cache_dtype) else \
            f"{self.kv_cache_dtype} ({served})"


@dataclass
class BenchResult:
    checkpoint: str
    workload: dict[str, Any]
    targets: dict[str, float | None]
    caches: list[CacheRun]
    vllm_python: str

    @property
    def checks(self) -> list[Check]:
        """What a release gates on: each quantized cache against `auto` at the same budget.
        capacity: more tokens; concurrency (with targets): at least as many concurrent
        requests within them. A cache that could not run is a skip, none running an error."""
        ran = {c.kv_cache_dtype: c for c in self.caches if c.ran}
        checks = [Check("bench", SKIP, f"{c.label}: not measured: {c.reason}")
                  for c in self.caches if not c.ran]
        if not ran:
            return [*checks, Check("bench", ERROR, "no KV cache could be measured")]
        auto = ran.get("auto")
        targets = any(v is not None for v in self.targets.values())
        for cache in (c for name, c in ran.items() if name != "auto"):
            if auto is None:
                checks.append(Check("capacity", SKIP, f"{cache.label}: no auto cache to "
                                    "compare with"))
                continue
            tokens = [(c.capacity or {}).get("tokens") for c in (cache, auto)]
            if None not in tokens:
                checks.append(Check("capacity", PASS if tokens[0] > tokens[1] else FAIL,
                                    f"{cache.label}: {tokens[0]:,} KV tokens at the budget, "
                                    f"auto {tokens[1]:,}", value=round(tokens[0] / tokens[1], 3)))
            if targets:
                mine, base = cache.useful_concurrency or 0, auto.useful_concurrency or 0
                checks.append(Check("concurrency", PASS if mine >= base else FAIL,
                                    f"{cache.label}: {mine or 'no'} concurrent requests within "
                                    f"the targets, auto {base or 'none'}", value=mine))
        return checks

    @property
    def exit_code(self) -> int:
        """1: a quantized cache holds no more tokens than `auto`, or (with targets) serves
        fewer concurrent requests within them; 2: no cache could be measured; else 0."""
        return exit_code(self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "workload": self.workload,
                "targets": self.targets, "vllm_python": self.vllm_python,
                "caches": [vars(c) for c in self.caches],
                "checks": [vars(c) for c in self.checks], "exit_code": self.exit_code}


def spread(values: list[float]) -> dict[str, float]:
    """Median and range of the repeats' values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def useful_concurrency(rows: list[dict[str, Any]], max_ttft_ms: float | None,
                       max_tpot_ms: float | None) -> int | None:
    """The largest concurrency whose worst repeat keeps p99 TTFT and p99 TPOT within the
    targets (None: no target met, or no targets given)."""
    if max_ttft_ms is None and max_tpot_ms is None:
        return None
    met = [row["concurrency"] for row in rows
           if (max_ttft_ms is None or row["p99_ttft_ms"]["max"] <= max_ttft_ms)
           and (max_tpot_ms is None or row["p99_tpot_ms"]["max"] <= max_tpot_ms)]
    return max(met, default=None)


def bench(checkpoint: str | Path, options: BenchOptions, log_dir: Path,
          log: Callable[[str], None]) -> BenchResult:
    """Start one server per cache and run vLLM's benchmark at every concurrency."""
    folder, python = engine.serving_checkpoint(checkpoint, options.vllm_python)
    config = load_config(folder)
    caches = []
    for dtype in options.kv_cache_dtypes:
        if dtype.startswith("fp8") and not engine.fp8_kv_supported(python):
            caches.append(CacheRun(dtype, False, engine.FP8_KV_UNSUPPORTED))
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
        with _server(python, folder, served, options, log_path) as url:
            facts = engine.parse_log(log_path.read_text(errors="replace"))
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


class ServerFailed(Exception):
    """The server did not start, died, or did not complete the benchmark."""


@contextlib.contextmanager
def _server(python: str, folder: Path, dtype: str, options: BenchOptions,
            log_path: Path) -> Iterator[str]:
    """`vllm serve` (vLLM's OpenAI server module) on a free port of 127.0.0.1, in a process
    group of its own, ended on the way out; yields its base URL once /health answers."""
    port = _free_port()
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--host", "127.0.0.1", "--port", str(port), "--kv-cache-dtype", dtype,
               "--max-model-len", str(options.max_model_len), "--seed", str(options.seed),
               "--kv-cache-memory-bytes", str(parse_budget(options.kv_budget)),
               *(["--enforce-eager"] if options.enforce_eager else [])]
    # The legacy variable would override the budget on CPU (vllm/platforms/cpu.py).
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["PYTHONUNBUFFERED"] = "1"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                   start_new_session=True, env=env, cwd=tempfile.gettempdir())
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + options.timeout
            while not _healthy(url):
                # The API server stays up when its engine dies at start: the log says so.
                failed = ENGINE_FAILED in log_path.read_text(errors="replace")
                if failed or process.poll() is not None or time.monotonic() > deadline:
                    facts = engine.parse_log(log_path.read_text(errors="replace"))
                    why = (facts.hardware or facts.root_cause
                           or (f"exited with code {process.returncode}"
                               if process.returncode is not None
                               else f"not ready within {options.timeout:g} s (--timeout)"))
                    raise ServerFailed(f"vllm serve did not start: {why.splitlines()[-1]}")
                time.sleep(1)
            yield url
        finally:
            engine.end_process_group(process)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


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
