"""`kvcalib lm-eval`: task accuracy (RULER needle-in-a-haystack by default) through
lm-evaluation-harness's vLLM backend, with the model-dtype cache, FP8 at scale 1.0 and
FP8 with the checkpoint's scales, compared example by example."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvcalib.cli._options import (
    JsonOut,
    JunitOut,
    folder_option,
    grouped,
    info,
    plot_option,
)
from kvcalib.cli._output import measure_served
from kvcalib.lmeval.options import LmEvalOptions

LogDir = folder_option("Folder for vLLM's and lm-eval's logs (default: beside --json, else "
                       "./kvcalib-lm-eval-logs/NAME).")
Plot = plot_option("Write accuracy against context length, a line per configuration, to "
                   "this file.")


@grouped
def lm_eval(
    checkpoint: Annotated[Path, typer.Argument(help="The checkpoint folder.")],
    options: LmEvalOptions = LmEvalOptions(),
    json_path: JsonOut = None,
    junit: JunitOut = None,
    plot: Plot = None,
    log_dir: LogDir = None,
) -> None:
    """Score lm-eval tasks (default: RULER's offline needle-in-a-haystack tasks) through
    vLLM once per configuration (auto, FP8 at scale 1.0, FP8 with the checkpoint's scales)
    on the same examples: accuracy per task, context length and needle depth, McNemar's
    exact test and a paired bootstrap interval per pair, and recovery (FP8 ÷ auto). Exit 1
    when FP8 with the checkpoint's scales recovers less than --min-recovery."""
    from kvcalib.lmeval.run import lm_eval as run_lm_eval
    from kvcalib.report.plots import lm_eval_plot

    measure_served("lm-eval", checkpoint, json_path, junit, log_dir, plot,
                   lambda logs: run_lm_eval(checkpoint, options, logs, log=info),
                   lambda result, path: lm_eval_plot(result, path) if result.table() else None)
