"""`kvcalib bench`'s summary: latency and throughput per cache; its table is the model
card's too."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcalib.tables import checks_table, result_line, right_aligned, table
from kvcalib.text import count

if TYPE_CHECKING:
    from kvcalib.bench.result import BenchResult, CacheRun


def bench_summary(result: BenchResult) -> str:
    """One row per cache and concurrency: median over the repeats (range in brackets)."""
    lines = [f"Checkpoint: {result.checkpoint}", workload_line(result.workload)]
    lines += [f"{cache.label}: not measured: {cache.reason}"
              for cache in result.caches if not cache.ran]
    rows = bench_rows(result.caches)
    if rows:
        lines += ["", table(BENCH_HEADERS, right_aligned(BENCH_HEADERS, rows))]
    targets = {k: v for k, v in result.targets.items() if v is not None}
    if targets:
        said = ", ".join(f"{k.removeprefix('max_').replace('_ms', '')} p99 <= {v:g} ms"
                         for k, v in targets.items())
        lines += ["", f"Useful concurrency ({said}, worst repeat): " + ", ".join(
            f"{c.label} {c.useful_concurrency or 'none'}" for c in result.caches if c.ran)]
    lines += ["", checks_table(result.checks)]
    lines += ["", result_line(result.exit_code)]
    return "\n".join(lines)


def workload_line(work: dict[str, Any]) -> str:
    return (f"Workload: {work['num_prompts']} requests x ({work['input_len']} prompt + "
            f"{work['output_len']} output tokens), {work['repeats']} repeats, max_model_len "
            f"{work['max_model_len']}" + (f", KV budget {work['kv_budget']}"
                                          if work["kv_budget"] else ""))


BENCH_HEADERS = ["cache", "KV tokens", "concurrency", "TTFT p50 ms", "TTFT p99 ms",
                 "TPOT p50 ms", "TPOT p99 ms", "output tok/s", "req/s", "preempted"]


def bench_rows(caches: list[CacheRun]) -> list[list[str]]:
    """One row per measured cache and concurrency, under BENCH_HEADERS (bench's table, and
    the model card's)."""
    rows = []
    for cache in caches:
        if not cache.ran:
            continue
        tokens = count(cache.capacity["tokens"]) if cache.capacity else "n/a"
        for row in cache.rows:
            rows.append([cache.label, tokens, str(row["concurrency"]),
                         *(_spread(row[key]) for key in (
                             "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms",
                             "output_throughput", "request_throughput", "preemptions"))])
    return rows


def _spread(values: dict[str, float]) -> str:
    median = values["median"]
    digits = ".0f" if abs(median) >= 100 or float(median).is_integer() else ".1f"
    if values["min"] == values["max"]:
        return f"{median:{digits}}"
    return f"{median:{digits}} [{values['min']:{digits}}-{values['max']:{digits}}]"
