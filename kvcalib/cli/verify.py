"""`kvcalib verify`: prove a checkpoint's FP8 KV scales are present, sane and used by vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvcalib.choices import comma_separated
from kvcalib.cli._options import (
    JsonOut,
    JunitOut,
    folder_option,
    grouped,
    info,
)
from kvcalib.cli._output import engine_command_output
from kvcalib.engine.targets import TARGETS
from kvcalib.verify.options import EngineOptions

LogDir = folder_option("Folder for vLLM's logs (default: beside --json, else "
                           "./kvcalib-verify-logs/NAME).")


@grouped
def verify(
    checkpoint: Annotated[Path, typer.Argument(help="The checkpoint folder.")],
    static_only: Annotated[bool, typer.Option(
        "--static-only", help="Only read config and scales; do not start vLLM.")] = False,
    options: EngineOptions = EngineOptions(),
    target: Annotated[list[str] | None, typer.Option(
        "--target", callback=comma_separated,
        help="Serving targets to gate on (repeat or use commas; `all`: every one): exit 1 "
             "unless each serves the scales as calibrated. Without it the common targets "
             f"are shown, gating nothing. Targets (docs/targets.md): {', '.join(TARGETS)}."
    )] = None,
    json_path: JsonOut = None,
    junit: JunitOut = None,
    log_dir: LogDir = None,
) -> None:
    """Prove the checkpoint's FP8 KV scales are present, sane and used by vLLM (exit 0)."""
    from kvcalib.verify.run import verify as run_verify

    out, logs = engine_command_output("verify", checkpoint, json_path, junit, log_dir,
                                      starts_engine=not static_only)
    result = run_verify(checkpoint, static_only=static_only, options=options, targets=target,
                        log_dir=logs, log=info)
    raise typer.Exit(out.emit(result))
