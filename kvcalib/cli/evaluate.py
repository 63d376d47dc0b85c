"""`kvcalib eval`: what FP8 KV (or every vLLM KV format) costs in accuracy."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from kvcalib.cli._options import (
    JsonOut,
    engine_log_dir,
    grouped,
    info,
    keep_inputs_intact,
    plot_option,
)
from kvcalib.cli._output import Output
from kvcalib.errors import UsageError
from kvcalib.evaluate.options import EvalOptions, Passkey

Plot = plot_option("Write a figure of per-layer sensitivity (with --sweep) and scales to this "
                   "file.")
Pareto = plot_option("With --formats: write the Pareto plot (tokens at the budget against mean "
                     "KL) to this file.")
# The command's defaults: the library's, with the passkey probe on.
DEFAULTS = EvalOptions(passkey=Passkey([1024, 2048], [0.1, 0.5, 0.9]))


@grouped
def evaluate(
    checkpoint: Annotated[Path, typer.Argument(help="The calibrated checkpoint folder.")],
    options: EvalOptions = DEFAULTS,
    json_path: JsonOut = None,
    plot: Plot = None,
    pareto: Pareto = None,
) -> None:
    """Measure what FP8 KV (or, with --formats, each vLLM KV format) costs in accuracy: KL,
    top-1, perplexity, passkey, per layer; with --formats, tokens at a budget too. Held-out
    text: --dataset as for `run`, by default the built-in corpus, without the rows the
    calibration used when it calibrated on it."""
    from kvcalib.evaluate.run import evaluate as run_evaluate
    from kvcalib.evaluate.separate import calibrated_from
    from kvcalib.report import plots

    if pareto is not None and not options.formats.names:
        raise UsageError("--pareto needs --formats")
    dataset = options.held_out.dataset
    out = Output(json_path)
    logs = engine_log_dir("eval", checkpoint, None, out.folder) if options.engine.engine else None
    keep_inputs_intact([checkpoint, dataset and dataset.source, options.simulation.reference,
                        calibrated_from(checkpoint)],
                       {"--json": json_path, "--plot": plot, "--pareto": pareto,
                        "the engine's log folder": logs})
    if logs is not None:
        options = dataclasses.replace(
            options, engine=dataclasses.replace(options.engine, log_dir=logs))
    result = run_evaluate(checkpoint, options, log=info)
    code = out.emit(result)
    if plot:  # after the result: a figure that fails loses nothing computed
        info(f"Plot: {plots.sensitivity_plot(result, plot)}")
    if pareto:
        info(f"Pareto plot: {plots.pareto_plot(result, pareto)}")
    raise typer.Exit(code)
