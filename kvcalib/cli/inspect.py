"""`kvcalib inspect`: a checkpoint's KV scales per layer and head, and their outliers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvcalib.choices import OUTLIER_RATIO
from kvcalib.cli._options import JsonOut, info, keep_inputs_intact, plot_option
from kvcalib.cli._output import Output

Plot = plot_option("Write a figure of the scales by layer and head (a heatmap per kind for "
                   "attn_head) to this file.")


def inspect(
    checkpoint: Annotated[Path, typer.Argument(help="The checkpoint folder.")],
    plot: Plot = None,
    heads: Annotated[bool, typer.Option(
        "--heads", help="Also list every head's scale (attn_head).")] = False,
    outlier_ratio: Annotated[float, typer.Option(
        min=1, help="Flag scales more than this many times above or below the median "
             "layer's.")] = OUTLIER_RATIO,
    json_path: JsonOut = None,
) -> None:
    """Show a checkpoint's KV scales per layer and head, the absmax they imply and outliers;
    reads the calibration report when present. Needs no engine."""
    from kvcalib.checkpoint.inspect import inspect as run_inspect
    from kvcalib.report.plots import scales_plot

    keep_inputs_intact([checkpoint], {"--json": json_path, "--plot": plot})
    out = Output(json_path)
    result = run_inspect(checkpoint, outlier_ratio=outlier_ratio)
    code = out.emit(result, result.summary(heads=heads))
    if plot is not None:  # after the result: a figure that fails loses nothing computed
        info(f"Plot: {scales_plot(result, plot)}")
    raise typer.Exit(code)
