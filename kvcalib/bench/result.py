"""What `kvcalib bench` found: one row per cache and concurrency, and the release checks."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from kvcalib.bench.summary import bench_summary
from kvcalib.checks import ERROR, FAIL, PASS, SKIP, Check, CommandResult

# vLLM's result keys that kvcalib reports (vllm/benchmarks/serve.py, `benchmark`'s result)
METRICS = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "output_throughput",
           "request_throughput")


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
class BenchResult(CommandResult):
    suite = "kvcalib.bench"

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

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "workload": self.workload,
                "targets": self.targets, "vllm_python": self.vllm_python,
                "caches": [vars(c) for c in self.caches],
                "checks": [vars(c) for c in self.checks], "exit_code": self.exit_code}

    def summary(self) -> str:
        return bench_summary(self)


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
