"""What `run` checks before anything is loaded: the model folder, the output target, how the
weights will be placed, the compute settings, and whether the model fits (see
kvcalib.calibrate.memory); then the tokenizer and model loaders, which turn loading
failures into one clear error.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcalib.calibrate import distributed, memory, weight_schemes
from kvcalib.calibrate.options import ComputeOptions, SampleOptions, ScaleOptions, WriteOptions
from kvcalib.checkpoint.expected import weight_problems
from kvcalib.checkpoint.read import Checkpoint, open_model
from kvcalib.checkpoint.safetensors import (
    INDEX_NAME,
    LONE_NAME,
    TensorInfo,
    file_tensors,
)
from kvcalib.checkpoint.write import choose_placement
from kvcalib.dtypes import DTYPES
from kvcalib.errors import UsageError
from kvcalib.hub import resolve_model
from kvcalib.kvcache import geometry
from kvcalib.reads import load_config
from kvcalib.writes import check_output_target


def check_launch(model: str | Path, output: str | Path, nproc: int, scales: ScaleOptions,
                 samples: SampleOptions, compute: ComputeOptions, writing: WriteOptions) -> None:
    """What `run --nproc-per-node` refuses once, before starting the ranks (each checks
    again). On GPUs the memory is left to each rank: asking a GPU here would create a CUDA
    context that holds memory for the whole job."""
    import torch

    distributed.check_nproc(nproc)
    distributed.shares(samples.num_samples, nproc)
    preflight(model, output, scales, samples, compute, writing,
              distributed.Ranks(world_size=nproc, local_world_size=nproc),
              plan_memory=not torch.cuda.is_available())


@dataclass
class Preflight:
    """What is known before anything is loaded (see `preflight`)."""

    source: Checkpoint  # the input model's config and tensor index
    target: Path
    placement: tuple[str, str]  # weights mode, and why
    compute: dict[str, str]
    memory: memory.Plan | None
    input_quantization: dict[str, Any] | None  # the input's quantization_config with weights


def preflight(model: str | Path, output: str | Path, scales: ScaleOptions,
              samples: SampleOptions, compute: ComputeOptions, writing: WriteOptions,
              ranks: distributed.Ranks, plan_memory: bool = True) -> Preflight:
    """Check the model folder, the output target, how weights will be placed and whether
    the model fits, all before anything is loaded. Only the writer (rank 0) checks the
    output: on other nodes its folder need not exist."""
    model_dir = resolve_model(str(model))
    target, scheme, weights = Path(output), scales.scheme, writing.weights
    if ranks.writer:
        target = check_output_target(target, model_dir, writing.overwrite)
    source = open_model(model_dir, _check_causal_lm(model_dir))
    loaded, which = _loaded_by_transformers(source)
    problems = weight_problems(loaded, source.config)
    if problems:  # transformers would fill them at random, or drop them, and calibrate noise
        raise UsageError(f"{model_dir}: {which}{problems.describe()}. transformers would "
                         "fill missing weights at random and drop unexpected ones, so the "
                         "scales would not be the model's; nothing was loaded")
    input_quant = weight_schemes.input_quantization(source)
    if scheme is not None and input_quant is not None:
        raise UsageError(f"--scheme quantizes the weights of an unquantized checkpoint, and "
                         f"{model_dir} is already weight-quantized; leave out --scheme to "
                         "add KV scales to it as it is")
    placement = (weights, "rank 0 writes")
    if scheme is not None:
        placement = ("compressed", f"--scheme {scheme}: quantized and written by "
                     "compressed-tensors")
    elif ranks.writer:
        placement = choose_placement(weights, [model_dir / name for name in
                                               source.weight_files], target.parent)
    settings = _compute_settings(source, compute.dtype)
    if not plan_memory:
        return Preflight(source, target, placement, settings, None, input_quant)
    device = _device(settings)
    per_rank = -(-samples.num_samples // ranks.world_size)  # at most this many per rank
    need = memory.need(source, settings["dtype"], samples.max_seq_len, per_rank)
    plan = memory.plan(compute.pipeline, need, memory.available(device, ranks.local_world_size),
                       device)
    if (plan.pipeline == "sequential" and device != "cpu"
            and ranks.world_size > ranks.local_world_size):
        raise UsageError("the sequential pipeline cannot run on several nodes: "
                         "llm-compressor 0.14.0.1 onloads layers to cuda:<global rank> "
                         "(utils/dev.py get_main_device), a GPU the other nodes lack; "
                         "use --pipeline basic (the model must fit one GPU) or one node")
    return Preflight(source, target, placement, settings, plan, input_quant)


def _loaded_by_transformers(source: Checkpoint) -> tuple[dict[str, TensorInfo], str]:
    """The tensors transformers will load, and how it picks them when that is not what the
    index says. It reads model.safetensors alone when that file exists, ignoring the index
    and every other file (modeling_utils._get_resolved_checkpoint_files); vLLM reads the
    index's files. A folder holding both would calibrate other weights than vLLM serves."""
    lone = source.folder / LONE_NAME
    if not lone.is_file() or set(source.weight_files) == {LONE_NAME}:
        return source.tensors, ""
    return (file_tensors(source.folder, LONE_NAME),
            f"transformers loads {LONE_NAME} alone when it exists (ignoring {INDEX_NAME} "
            "and the other files), and with it the ")


def _check_causal_lm(model_dir: Path) -> dict[str, Any]:
    """The config as a dict, once we know transformers can build a causal LM from it and
    the folder has weights to calibrate."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = load_config(model_dir)
    weight_schemes.declared_quantization(model_dir, config)
    try:
        AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, OSError) as exc:
        raise UsageError(f"{model_dir}: transformers cannot read this config: "
                         f"{str(exc).splitlines()[0]}") from None
    if config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(f"{model_dir}: model type {config.get('model_type')!r} is not a "
                         "causal language model transformers can load")
    reason = geometry.unloadable_scales(config)
    if reason:
        raise UsageError(f"{model_dir}: {reason}. kvcalib writes no scales the engine would "
                         "not use")
    return config


def load_tokenizer(model_dir: Path):
    """The model's tokenizer; a folder without one is a usage error, not a traceback."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except Exception as exc:  # transformers raises many types for a missing tokenizer
        first_line = next(iter(str(exc).splitlines()), type(exc).__name__)
        raise UsageError(f"cannot load the tokenizer of {model_dir}: {first_line}") from None


def _compute_settings(source: Checkpoint, dtype: str) -> dict[str, str]:
    """Device and compute dtype; bf16/fp16 matmuls without native CPU support run several
    times slower than fp32, so `auto` computes in float32 there."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    stored = _checkpoint_dtype(source)
    if dtype == "auto":
        native_half = device == "cuda" or torch.cpu._is_avx512_bf16_supported()
        dtype = stored if native_half or stored == "float32" else "float32"
    return {"device": device, "dtype": dtype, "checkpoint_dtype": stored}


def _device(compute: dict[str, str]) -> str:
    """This rank's device: torchrun's ranks each use their own GPU (set by init_dist)."""
    if compute["device"] == "cpu":
        return "cpu"
    import torch

    return f"cuda:{torch.cuda.current_device()}"


def load_model(model_dir: Path, dtype: str, device: str, options: dict[str, Any],
                attention: str):
    """Load for calibration, on `device` (the sequential pipeline onloads from the CPU
    itself), with `options` for from_pretrained (weight_schemes.load_options), under
    `attention` (transformers' attn_implementation)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), attn_implementation=attention,
            device_map=None if device == "cpu" else device, **options,
        )
    except Exception as exc:  # transformers raises many types for unloadable models
        raise UsageError(f"cannot load {model_dir} as a causal LM: "
                         f"{str(exc).splitlines()[0]}") from None
    model.eval()
    return model


def _checkpoint_dtype(source: Checkpoint) -> str:
    """The floating dtype most weight bytes are stored in; scales are saved in it."""
    sizes: dict[str, int] = {}
    for info in source.tensors.values():
        if info.dtype in ("BF16", "F16", "F32"):
            sizes[info.dtype] = sizes.get(info.dtype, 0) + info.end - info.start
    if not sizes:
        raise UsageError(f"{source.folder} has no bf16, fp16 or fp32 weights to calibrate")
    return DTYPES[max(sizes, key=sizes.get)].torch


