"""`kvcalib bench`: latency, throughput and useful concurrency of the checkpoint's FP8 KV
cache against the model-dtype cache, measured by vLLM's `bench serve` on a local server."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvcalib.bench.options import BenchOptions
from kvcalib.cli._options import (
    JsonOut,
    JunitOut,
    folder_option,
    grouped,
    info,
    plot_option,
)
from kvcalib.cli._output import measure_served

LogDir = folder_option("Folder for the servers' logs and vLLM's result files (default: "
                       "beside --json, else ./kvcalib-bench-logs/NAME).")
Plot = plot_option("Write throughput and p99 TPOT against concurrency, a line per cache, to "
                   "this file.")


@grouped
def bench(
    checkpoint: Annotated[Path, typer.Argument(help="The checkpoint folder.")],
    options: BenchOptions = BenchOptions(),
    json_path: JsonOut = None,
    junit: JunitOut = None,
    plot: Plot = None,
    log_dir: LogDir = None,
) -> None:
    """Serve the checkpoint once per KV cache (auto, fp8) and run vLLM's own `bench serve`
    at each concurrency: TTFT and TPOT (p50, p99), output tokens/s, requests/s, preemptions
    and the capacity line, median and range over repeats. With --max-ttft-ms/--max-tpot-ms:
    the largest concurrency within them per cache. Exit 1 when FP8 holds no more tokens than
    auto at the same --kv-budget, or serves fewer concurrent requests within the targets."""
    from kvcalib.bench.run import bench as run_bench
    from kvcalib.report.plots import bench_plot

    measure_served("bench", checkpoint, json_path, junit, log_dir, plot,
                   lambda logs: run_bench(checkpoint, options, logs, log=info),
                   lambda result, path: bench_plot(result, path)
                   if any(c.ran for c in result.caches) else None)
