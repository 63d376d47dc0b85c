"""`kvcalib run`: calibrate FP8 KV-cache scales into a checkpoint."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from kvcalib.calibrate.options import ComputeOptions, SampleOptions, ScaleOptions, WriteOptions
from kvcalib.cli._options import (
    JsonOut,
    OutputFolder,
    grouped,
    info,
    keep_inputs_intact,
    plot_option,
)
from kvcalib.cli._output import Output

Plot = plot_option("Write a figure of each layer's running absmax / final value against "
                   "samples (did the scales converge?).")


@grouped
def run(
    model: Annotated[str, typer.Option(help="Local Hugging Face model folder or hub id.")],
    output: OutputFolder,
    scales: ScaleOptions = ScaleOptions(),
    samples: SampleOptions = SampleOptions(),
    compute: ComputeOptions = ComputeOptions(),
    writing: WriteOptions = WriteOptions(),
    nproc_per_node: Annotated[int | None, typer.Option(
        help="Calibrate on N ranks of this node through torchrun (one per GPU, or CPU "
             "processes), each on its share of the samples. Several nodes: run torchrun "
             "yourself (see docs/run.md).")] = None,
    json_path: JsonOut = None,
    plot: Plot = None,
) -> None:
    """Calibrate FP8 KV-cache scales into a checkpoint vLLM loads with kv_cache_dtype=fp8."""
    from kvcalib.calibrate import distributed
    from kvcalib.calibrate.preflight import check_launch
    from kvcalib.calibrate.run import calibrate

    keep_inputs_intact([model, samples.dataset.source], {"--json": json_path, "--plot": plot})
    out = Output(json_path)
    if nproc_per_node not in (None, 1):
        check_launch(model, output, nproc_per_node, scales, samples, compute, writing)
        raise typer.Exit(distributed.launch(nproc_per_node, sys.argv[1:]))
    result = calibrate(model, output, scales=scales, samples=samples, compute=compute,
                       writing=writing, log=info)
    if result.rank != 0:
        return  # rank 0 prints for the job
    code = out.emit(result)
    if plot:  # after the result: a figure that fails loses nothing computed
        from kvcalib.report.plots import convergence_plot

        info(f"Plot: {convergence_plot(result.report, plot)}")
    raise typer.Exit(code)
