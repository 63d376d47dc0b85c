"""`kvcalib estimate`: KV-cache bytes per token and per request, and what fits a budget."""

from __future__ import annotations

from typing import Annotated

import typer

from kvcalib.cli._options import JsonOut, grouped, keep_inputs_intact
from kvcalib.cli._output import Output
from kvcalib.kvcache.capacity import EstimateOptions


@grouped
def estimate(
    model: Annotated[str, typer.Argument(
        help="Model folder, its config.json, or a hub id (only config.json is fetched).")],
    options: EstimateOptions = EstimateOptions(),
    json_path: JsonOut = None,
) -> None:
    """KV-cache bytes per token and per request in 16-bit, fp8 and 2-bit KIVI (with
    --formats, any vLLM KV format), and what fits in a memory budget. Only attention layers
    count; Mamba and other layers are listed."""
    from kvcalib.kvcache.capacity import estimate as run_estimate

    keep_inputs_intact([model], {"--json": json_path})
    out = Output(json_path)
    result = run_estimate(model, options)
    raise typer.Exit(out.emit(result))
