"""`kvcalib convert`: a checkpoint's FP8 KV scales in another format vLLM loads."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kvcalib.choices import ScaleLayout, Strategy
from kvcalib.cli._options import JsonOut, OutputFolder, Overwrite, keep_inputs_intact
from kvcalib.cli._output import Output


def convert(
    checkpoint: Annotated[Path, typer.Argument(
        help="The checkpoint folder: compressed-tensors, ModelOpt or Quark KV scales, "
             "weights not quantized.")],
    output: OutputFolder,
    to: Annotated[ScaleLayout | None, typer.Option(
        "--to", help="Format to write: compressed-tensors, modelopt or quark (default: the "
                     "checkpoint's own).")] = None,
    strategy: Annotated[Strategy | None, typer.Option(
        help="Scales to write: tensor (attn_head scales become the largest head's, the "
             "portable form: vLLM refuses per-head scales on attention backends other than "
             "FlashAttention 3) or attn_head (default: the checkpoint's where the format "
             "keeps per-head scales, else tensor).")] = None,
    overwrite: Overwrite = False,
    json_path: JsonOut = None,
) -> None:
    """Rewrite a checkpoint's FP8 KV scales and quantization config in another format that
    vLLM loads, or per-head scales as per-tensor ones; every other tensor is copied byte for
    byte."""
    from kvcalib.checkpoint.convert import convert as run_convert

    keep_inputs_intact([checkpoint], {"--json": json_path})
    out = Output(json_path)
    result = run_convert(checkpoint, to, output, overwrite=overwrite, strategy=strategy)
    raise typer.Exit(out.emit(result))
