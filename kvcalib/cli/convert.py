"""`kvcalib convert`: a checkpoint's FP8 KV scales in another format vLLM loads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvcalib.choices import ScaleLayout
from kvcalib.cli._options import JsonOut, OutputFolder, Overwrite, keep_inputs_intact
from kvcalib.cli._output import Output


def convert(
    checkpoint: Annotated[Path, typer.Argument(
        help="The checkpoint folder: compressed-tensors, ModelOpt or Quark KV scales, "
             "weights not quantized.")],
    to: Annotated[ScaleLayout, typer.Option(
        "--to", help="Format to write: compressed-tensors, modelopt or quark.")],
    output: OutputFolder,
    overwrite: Overwrite = False,
    json_path: JsonOut = None,
) -> None:
    """Rewrite a checkpoint's FP8 KV scales and quantization config in another format that
    vLLM loads; every other tensor is copied byte for byte."""
    from kvcalib.checkpoint.convert import convert as run_convert

    keep_inputs_intact([checkpoint], {"--json": json_path})
    out = Output(json_path)
    result = run_convert(checkpoint, to, output, overwrite=overwrite)
    raise typer.Exit(out.emit(result))
