"""Calibrate FP8 KV-cache scales with llm-compressor and write a release-ready checkpoint.

llm-compressor measures the scales (QuantizationModifier with a kv_cache_scheme). This
module chooses what it gets wrong by default and writes the output itself:

- observer: the true running absmax (`static_minmax`), not the EMA default, which
  measured up to 42% low on SmolLM2 and clips the largest keys and values;
- q_scale: llm-compressor 0.14.0.1 forces eager attention while calibrating, which
  bypasses compressed-tensors' hooked attention, so q is never observed and q_scale is
  saved as uninitialized memory. `_calibration_attention` keeps the hooked attention;
- attention: eager by default, as llm-compressor calibrates, so the scales are bit for bit
  its own. `sdpa` (basic pipeline) skips materializing the S x S scores; it gives the
  same scales in float32 and moves some by a few bf16 steps when computing in bf16;
- output: the input's weight files are copied, cloned or linked (kvcalib.weights) and
  the scales are added in their own file, so every weight is bit-identical to the input;
- our own hooks record each sample's absmax of every K/V/Q tensor in float32, so each
  scale is checked against what was really seen before anything is written, and the
  report says when each scale stopped growing (kvcalib.convergence);
- work: no logits are needed, so the basic pipeline stops each forward pass once the
  last attention layer's K and V (and Q) are seen: the rest of that layer, the final
  norm and lm_head never run;
- scale: under torchrun every rank calibrates its share of the samples
  (kvcalib.distributed), and the pipeline is chosen, or the model refused, from the
  bytes it needs before it is loaded (kvcalib.memory).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from kvcalib import (
    checkpoint,
    choices,
    convergence,
    data,
    distributed,
    geometry,
    layouts,
    memory,
    weight_schemes,
)
from kvcalib import weights as weight_files
from kvcalib.errors import CheckFailed, UsageError
from kvcalib.kvcheckpoint import Checkpoint, open_model
from kvcalib.kvformats import E4M3_MAX
from kvcalib.schema import REPORT_FILE, REPORT_SCHEMA_VERSION

# llm-compressor logs INFO lines and a CPU warning per stage; keep its errors only,
# unless the user asks for more.
os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", "ERROR")

SCALES_FILE = "kv_scales.safetensors"
# What the ranks wait for before the checkpoint appears (named if a rank is lost there).
WRITTEN = "rank 0 wrote the checkpoint"
# A measured absmax and its stored scale may differ by the rounding of the model dtype.
SCALE_RTOL = 2**-7


@dataclass
class CalibrationResult:
    """Where the checkpoint went and what was measured (the content of the report).

    Under torchrun every rank gets one; only rank 0 wrote the checkpoint.
    """

    output: Path
    report: dict[str, Any]
    rank: int = 0

    @property
    def layers(self) -> list[dict[str, Any]]:
        return self.report["layers"]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def calibrate(
    model: str | Path,
    output: str | Path,
    *,
    strategy: str = "tensor",
    q_scale: bool = False,
    dataset: data.DatasetSpec | None = None,
    num_samples: int = 512,
    max_seq_len: int = 2048,
    seed: int = 0,
    observer: str = "static_minmax",
    pipeline: str = "auto",
    dtype: str = "auto",
    attention: str = "eager",
    weights: str = "auto",
    scheme: str | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] = _stderr,
) -> CalibrationResult:
    """Measure FP8 KV scales of `model` on `dataset` and write `output` atomically.

    With `scheme` (a compressed-tensors preset) the weights are quantized in the same pass
    and written compressed; without it the input's weight files are copied bit for bit.
    Under torchrun each rank calibrates its share of the samples; rank 0 alone writes,
    and every rank returns the same report once the checkpoint is in place.
    """
    check_options(strategy, observer, pipeline, dtype, weights, num_samples, max_seq_len,
                  scheme, attention)
    dataset = dataset or data.DatasetSpec()
    started = time.perf_counter()
    with distributed.joined() as ranks:
        if not ranks.writer:
            log = _silent  # rank 0 speaks for the job
        checked = preflight(model, output, overwrite, weights, dtype=dtype, pipeline=pipeline,
                            max_seq_len=max_seq_len, num_samples=num_samples, ranks=ranks,
                            scheme=scheme)
        source, compute, plan = checked.source, checked.compute, checked.memory
        model_dir, config = source.folder, source.config
        input_quant = checked.input_quantization
        log(f"Loading {model_dir}" + (f" on {ranks.world_size} ranks ({ranks.backend})"
                                      if ranks.world_size > 1 else ""))
        tokenizer = _load_tokenizer(model_dir)
        samples = data.select_samples(dataset, tokenizer, num_samples, max_seq_len, seed)
        if len(samples.token_ids) < num_samples:
            log(f"Only {len(samples.token_ids)} usable samples in {dataset.source} "
                f"(asked for {num_samples}); calibrating on those.")
        shares = distributed.shares(len(samples.token_ids), ranks.world_size)
        if ranks.world_size > 1 and observer != "static_minmax":
            log(f"Warning: llm-compressor averages {observer} statistics over the ranks, so "
                f"the scales depend on the number of ranks ({ranks.world_size}); "
                "static_minmax takes their maximum and does not")
        if attention == "sdpa" and plan.pipeline == "sequential":
            log("The sequential pipeline traces under eager attention: calibrating with "
                "eager, not sdpa")
            attention = "eager"
        compute = {**compute, "attention": attention}
        torch_model = _load_model(model_dir, compute["dtype"],
                                  plan.device if plan.pipeline == "basic" else "cpu",
                                  weight_schemes.load_options(input_quant), attention)
        modules = _attention_modules(torch_model, config)
        if scheme is not None:
            weight_schemes.check_fits(torch_model, scheme)
        load_s = time.perf_counter() - started

        log(f"Calibrating {len(modules)} attention layers on {len(samples.token_ids)} "
            f"samples ({samples.num_tokens} tokens), strategy {strategy}, observer {observer}, "
            f"pipeline {plan.pipeline} ({plan.reason}), {attention} attention, "
            f"{compute['dtype']} on {compute['device']}")
        attention_classes = _attention_classes(modules) if q_scale else None
        modifier = build_modifier(strategy, observer, attention_classes, scheme)
        t0 = time.perf_counter()
        mine = [samples.token_ids[i] for i in shares[ranks.rank]]
        recorder = _run_oneshot(torch_model, tokenizer, modifier, mine, plan.pipeline,
                                modules, q_scale, whole_model=scheme is not None)
        per_sample = _gather(recorder.per_sample(), ranks)
        calibrate_s = time.perf_counter() - t0

        kinds = ("k", "v", "q") if q_scale else ("k", "v")
        scales = _scale_tensors(modules, kinds, compute["checkpoint_dtype"])
        layers = _collect_scales(scales, per_sample, observer)
        flagged = convergence.flagged(layers, kinds)
        if flagged:
            log(convergence.describe(flagged, len(layers) * len(kinds), len(samples.token_ids)))
        quant_config = _quantization_config(torch_model, compressed=scheme is not None)
        if input_quant is not None:
            quant_config = weight_schemes.with_kv_scheme(input_quant, quant_config,
                                                         attention_classes)
        weight_quant = None
        if scheme is not None or input_quant is not None:
            weight_quant = weight_schemes.report(quant_config,
                                                 "run" if scheme else "input", scheme)
        report = {
            "schema_version": REPORT_SCHEMA_VERSION,
            "kvcalib_version": metadata.version("kvcalib"),
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "model": {"source": str(model), "path": str(model_dir),
                      "architecture": (config.get("architectures") or ["?"])[0],
                      "model_type": config.get("model_type")},
            "scheme": {"num_bits": 8, "type": "float", "format": "float8_e4m3fn",
                       "fp8_max": E4M3_MAX, "strategy": strategy, "q_scale": q_scale,
                       "observer": observer},
            "dataset": {**samples.dataset, "rows_used": samples.rows},
            "samples": {"requested": num_samples, "used": len(samples.token_ids),
                        "max_seq_len": max_seq_len, "num_tokens": samples.num_tokens,
                        "seed": seed},
            "pipeline": {"requested": pipeline, "used": plan.pipeline, "reason": plan.reason},
            "compute": compute,
            "distributed": distributed.summary(ranks, shares, samples.rows),
            "memory": {"weights": plan.need.weights, "activations": plan.need.activations,
                       "needed": plan.needed, "free": plan.free.device,
                       "capped": plan.free.capped},
            "weights": {"requested": weights, "used": checked.placement[0],
                        "reason": checked.placement[1]},
            "weight_quantization": weight_quant,
            "convergence": {"late_growth_threshold": convergence.LATE_GROWTH,
                            "flagged": flagged, "note": convergence.FLAG_NOTE},
            "versions": _versions(),
            "timings_s": {"load": round(load_s, 3), "calibrate": round(calibrate_s, 3)},
            "layers": layers,
        }
        if ranks.writer:
            t0 = time.perf_counter()
            log(f"Writing {checked.target}")
            with checkpoint.atomic_output_dir(checked.target, overwrite) as tmp:
                if scheme is None:
                    write_checkpoint(tmp, source, scales, quant_config,
                                     _recipe_yaml(modifier), weights=checked.placement[0])
                else:
                    written = write_quantized_checkpoint(tmp, model_dir, torch_model, scales,
                                                         compute["checkpoint_dtype"],
                                                         _recipe_yaml(modifier))
                    report["weight_quantization"] = weight_schemes.report(written, "run",
                                                                          scheme)
                report["timings_s"]["save"] = round(time.perf_counter() - t0, 3)
                report["timings_s"]["total"] = round(time.perf_counter() - started, 3)
                (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
                # The checkpoint appears only once every rank is still there.
                distributed.barrier(ranks, WRITTEN)
        else:
            distributed.barrier(ranks, WRITTEN)
    return CalibrationResult(checked.target, report, ranks.rank)


def _silent(_message: str) -> None:
    pass


def check_options(strategy: str, observer: str, pipeline: str, dtype: str, weights: str,
                  num_samples: int, max_seq_len: int, scheme: str | None = None,
                  attention: str = "eager") -> None:
    """The option checks that need no files: before anything slow starts."""
    weight_schemes.check_preset(scheme)
    choices.check("strategy", strategy, choices.Strategy)
    choices.check("observer", observer, choices.Observer)
    choices.check("pipeline", pipeline, choices.Pipeline)
    choices.check("attention", attention, choices.Attention)
    if attention == "sdpa" and pipeline == "sequential":
        raise UsageError("--attention sdpa needs the basic pipeline: llm-compressor's "
                         "sequential pipeline traces each layer under eager attention")
    choices.check("dtype", dtype, choices.ComputeDtype)
    choices.check("weights mode", weights, choices.WeightsMode)
    data.check_sample_args(num_samples, max_seq_len)


def check_launch(model: str | Path, output: str | Path, overwrite: bool, nproc: int, *,
                 strategy: str, observer: str, pipeline: str, dtype: str, weights: str,
                 num_samples: int, max_seq_len: int, scheme: str | None = None,
                 attention: str = "eager") -> None:
    """What `run --nproc-per-node` refuses once, before starting the ranks (each checks
    again). On GPUs the memory is left to each rank: asking a GPU here would create a CUDA
    context that holds memory for the whole job."""
    import torch

    distributed.check_nproc(nproc)
    check_options(strategy, observer, pipeline, dtype, weights, num_samples, max_seq_len,
                  scheme, attention)
    distributed.shares(num_samples, nproc)
    preflight(model, output, overwrite, weights, dtype=dtype, pipeline=pipeline,
              max_seq_len=max_seq_len, num_samples=num_samples,
              ranks=distributed.Ranks(world_size=nproc, local_world_size=nproc),
              plan_memory=not torch.cuda.is_available(), scheme=scheme)


@dataclass
class Preflight:
    """What is known before anything is loaded (see `preflight`)."""

    source: Checkpoint  # the input model's config and tensor index
    target: Path
    placement: tuple[str, str]  # weights mode, and why
    compute: dict[str, str]
    memory: memory.Plan | None
    input_quantization: dict[str, Any] | None  # the input's quantization_config with weights


def preflight(model: str | Path, output: str | Path, overwrite: bool, weights: str, *,
              dtype: str, pipeline: str, max_seq_len: int, num_samples: int,
              ranks: distributed.Ranks, plan_memory: bool = True,
              scheme: str | None = None) -> Preflight:
    """Check the model folder, the output target, how weights will be placed and whether
    the model fits, all before anything is loaded. Only the writer (rank 0) checks the
    output: on other nodes its folder need not exist."""
    model_dir = checkpoint.resolve_model(str(model))
    target = Path(output)
    if ranks.writer:
        target = checkpoint.check_output_target(target, model_dir, overwrite)
    source = open_model(model_dir, _check_causal_lm(model_dir))
    input_quant = weight_schemes.input_quantization(model_dir, source.config)
    if scheme is not None and input_quant is not None:
        raise UsageError(f"--scheme quantizes the weights of an unquantized checkpoint, and "
                         f"{model_dir} is already weight-quantized; leave out --scheme to "
                         "add KV scales to it as it is")
    placement = (weights, "rank 0 writes")
    if scheme is not None:
        placement = ("compressed", f"--scheme {scheme}: quantized and written by "
                     "compressed-tensors")
    elif ranks.writer:
        placement = weight_files.choose(weights, [model_dir / name for name in
                                                  checkpoint.weight_files(model_dir)],
                                        target.parent)
    compute = _compute_settings(source, dtype)
    if not plan_memory:
        return Preflight(source, target, placement, compute, None, input_quant)
    device = _device(compute)
    per_rank = -(-num_samples // ranks.world_size)  # at most this many samples per rank
    plan = memory.plan(pipeline, memory.estimate(source, compute["dtype"], max_seq_len, per_rank),
                       memory.available(device, ranks.local_world_size), device)
    if (plan.pipeline == "sequential" and device != "cpu"
            and ranks.world_size > ranks.local_world_size):
        raise UsageError("the sequential pipeline cannot run on several nodes: "
                         "llm-compressor 0.14.0.1 onloads layers to cuda:<global rank> "
                         "(utils/dev.py get_main_device), a GPU the other nodes lack; "
                         "use --pipeline basic (the model must fit one GPU) or one node")
    return Preflight(source, target, placement, compute, plan, input_quant)


def _check_causal_lm(model_dir: Path) -> dict[str, Any]:
    """The config as a dict, once we know transformers can build a causal LM from it and
    the folder has weights to calibrate."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = checkpoint.load_config(model_dir)
    try:
        AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, OSError) as exc:
        raise UsageError(f"{model_dir}: transformers cannot read this config: "
                         f"{str(exc).splitlines()[0]}") from None
    if config.get("model_type") not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UsageError(f"{model_dir}: model type {config.get('model_type')!r} is not a "
                         "causal language model transformers can load")
    try:
        checkpoint.weight_files(model_dir)
    except checkpoint.CheckpointError as exc:  # the input is unusable: not a failed check
        raise UsageError(str(exc)) from None
    return config


def _load_tokenizer(model_dir: Path):
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


def _load_model(model_dir: Path, dtype: str, device: str, options: dict[str, Any],
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
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    sizes: dict[str, int] = {}
    for info in source.tensors.values():
        if info.dtype in names:
            sizes[info.dtype] = sizes.get(info.dtype, 0) + info.end - info.start
    if not sizes:
        raise UsageError(f"{source.folder} has no bf16, fp16 or fp32 weights to calibrate")
    return names[max(sizes, key=sizes.get)]


def _attention_modules(model, config: dict[str, Any]) -> dict[str, Any]:
    """Attention modules compressed-tensors can hook, by module name."""
    from compressed_tensors.quantization import is_cached_attention_module

    found = {name: m for name, m in model.named_modules() if is_cached_attention_module(m)}
    if not found:
        arch = (config.get("architectures") or [config.get("model_type")])[0]
        raise UsageError(f"{arch} has no attention layers llm-compressor can hook (it looks "
                         "for attention modules that take past_key_values); kvcalib cannot "
                         "calibrate its KV cache")
    return found


def _attention_classes(attention: dict[str, Any]) -> list[str]:
    return sorted({type(m).__name__ for m in attention.values()})


def kv_quantization_args(strategy: str, observer: str):
    """FP8 E4M3, static, symmetric: the only KV scheme vLLM loads from compressed-tensors."""
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=8, type="float", strategy=strategy, dynamic=False,
                            symmetric=True, observer=observer)


def build_modifier(strategy: str, observer: str, attention_classes: list[str] | None,
                   scheme: str | None = None):
    """The llm-compressor modifier; with attention classes it also calibrates q_scale, and
    with a preset `scheme` it quantizes the weights of every Linear layer but lm_head."""
    from compressed_tensors.quantization import QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    args = kv_quantization_args(strategy, observer)
    groups = weight_schemes.preset_groups(scheme) if scheme else {}
    if attention_classes:
        groups["attention"] = QuantizationScheme(targets=attention_classes,
                                                 input_activations=args)
    return QuantizationModifier(ignore=weight_schemes.IGNORE, kv_cache_scheme=args,
                                config_groups=groups or None)


def _recipe_yaml(modifier) -> str:
    from llmcompressor.recipe import Recipe

    return Recipe.from_modifiers([modifier]).yaml()


class _AbsmaxRecorder:
    """Each sample's per-head absmax of the post-RoPE states llm-compressor's observers see
    (batch size 1: one hook call per sample, layer and kind).

    Values go into one array per layer and kind, made at the first sample: thousands of
    small tensors kept alive between the forward passes' large ones would fragment the
    heap and grow the process by megabytes per sample.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self.values: dict[tuple[str, str], np.ndarray] = {}
        self.seen: dict[tuple[str, str], int] = {}

    def hook(self, name: str, kind: str) -> Callable:
        key = (name, kind)

        def record(_module, states):  # states: (1, heads, seq, head_dim)
            amax = states.detach().abs().amax(dim=(0, 2, 3)).float().cpu().numpy()
            if key not in self.values:
                self.values[key] = np.zeros((self.count, amax.size), dtype=np.float32)
            sample = self.seen.get(key, 0)
            if sample < self.count:
                self.values[key][sample] = amax
            self.seen[key] = sample + 1

        return record

    def per_sample(self) -> dict[tuple[str, str], np.ndarray]:
        """(samples, heads) per (module, kind), in the order the samples were fed."""
        for (name, kind), seen in self.seen.items():
            if seen != self.count:
                raise CheckFailed(f"{name}: kvcalib's {kind} hook saw {seen} samples, "
                                  f"expected {self.count}; nothing was saved")
        return self.values


class _StopForward(Exception):
    """Raised once the last attention layer has run: nothing after it changes a scale."""


@contextlib.contextmanager
def _stop_after(model, last: Any) -> Iterator[None]:
    """Make every forward pass of `model` end once module `last` has run: the last MLP,
    the final norm and lm_head never run (the basic pipeline ignores the outputs)."""
    def stop(_module, _args, _output):
        raise _StopForward

    forward = model.forward

    @functools.wraps(forward)
    def until_last_attention(*args, **kwargs):
        with contextlib.suppress(_StopForward):
            return forward(*args, **kwargs)

    handle = last.register_forward_hook(stop)
    model.forward = until_last_attention
    try:
        yield
    finally:
        handle.remove()
        del model.forward


def _run_oneshot(model, tokenizer, modifier, token_ids: list[list[int]], pipeline: str,
                 attention: dict[str, Any], q_scale: bool,
                 whole_model: bool = False) -> _AbsmaxRecorder:
    """Calibrate on `token_ids`, one sample per batch, in the order given. `whole_model`:
    every layer must see the samples (static activation scales of a weight scheme)."""
    from compressed_tensors.modeling import (
        KV_CACHE_ATTR,
        initialize_hooked_attention,
        initialize_hooked_kv_cache,
    )
    from llmcompressor import oneshot
    from llmcompressor.modifiers.utils.hooks import HooksMixin
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    recorder = _AbsmaxRecorder(len(token_ids))
    # Registered like llm-compressor's own hooks, so that the sequential pipeline's second
    # pass over each layer (which only propagates outputs) does not record again.
    hooks = HooksMixin()
    for name, module in attention.items():
        # The same hook points llm-compressor attaches its observers to (idempotent).
        if q_scale:
            initialize_hooked_attention(model, module)
            hooks.register_hook(module, recorder.hook(name, "q"), "query")
        initialize_hooked_kv_cache(model, module)
        hooks.register_hook(module, recorder.hook(name, "k"), "key")
        hooks.register_hook(module, recorder.hook(name, "v"), "value")
    # Our own loader keeps the samples in the seeded order (llm-compressor would sort
    # them by length), so that sample numbers mean the same everywhere.
    batches = DataLoader([{"input_ids": ids, "attention_mask": [1] * len(ids)}
                          for ids in token_ids], batch_size=1, collate_fn=default_data_collator)
    last = max(attention.items(), key=lambda item: layer_index(item[0]))[1]
    # Without q, the last layer's keys and values are all that is needed of it: stop once
    # its cache has seen them, before its attention and output projection.
    stop_at = last if q_scale else getattr(last, KV_CACHE_ATTR)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_calibration_attention(model, attention, q_scale))
            if pipeline == "basic" and not whole_model:
                stack.enter_context(_stop_after(model, stop_at))
            oneshot(model=model, processor=tokenizer, dataset=batches, recipe=[modifier],
                    pipeline=pipeline)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        raise CheckFailed(f"calibration failed in llm-compressor: {type(exc).__name__}: "
                          f"{exc}") from exc
    finally:
        hooks.remove_hooks()
    return recorder


def _gather(per_sample: dict[tuple[str, str], np.ndarray], ranks: distributed.Ranks,
            ) -> dict[tuple[str, str], np.ndarray]:
    """Every rank's per-sample absmax, in the order of the whole sample list."""
    gathered = distributed.all_gather(per_sample, ranks, "gathering the absmax seen")
    return {key: np.concatenate([part[key] for part in gathered]) for key in per_sample}


@contextlib.contextmanager
def _calibration_attention(model, attention: dict[str, Any], q_scale: bool,
                           ) -> Iterator[None]:
    """Calibrate under the attention `model` was loaded with (see the module docstring).

    llm-compressor forces eager attention while calibrating. Under eager without q_scale
    that changes nothing, and is left alone. Otherwise it is turned off: sdpa stays sdpa,
    and with q_scale compressed-tensors' hooked attention stays in place (it observes the
    queries), given the model's own eager function under the name it looks up.
    """
    import llmcompressor.utils.helpers as helpers
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if model.config._attn_implementation == "eager" and not q_scale:
        yield
        return
    module = sys.modules[type(next(iter(attention.values()))).__module__]
    forced_eager = helpers.use_eager_attention
    had_eager = "eager" in ALL_ATTENTION_FUNCTIONS
    previous = ALL_ATTENTION_FUNCTIONS["eager"] if had_eager else None
    helpers.use_eager_attention = lambda model: contextlib.nullcontext()
    ALL_ATTENTION_FUNCTIONS["eager"] = module.eager_attention_forward
    try:
        yield
    finally:
        helpers.use_eager_attention = forced_eager
        if had_eager:
            ALL_ATTENTION_FUNCTIONS["eager"] = previous
        else:
            del ALL_ATTENTION_FUNCTIONS["eager"]


def layer_index(module_name: str) -> int:
    layer = geometry.layer_number(module_name)
    if layer is None:
        raise UsageError(f"cannot tell the layer number of attention module {module_name}")
    return layer


def _scale_tensors(attention: dict[str, Any], kinds: tuple[str, ...], dtype: str) -> dict[str, Any]:
    """The scales as they will be saved: in the checkpoint's dtype, named by module."""
    import torch

    scales = {}
    for name, module in attention.items():
        for kind in kinds:
            scale = getattr(module, f"{kind}_scale", None)
            if scale is None:
                raise CheckFailed(f"{name}: llm-compressor produced no {kind}_scale")
            scales[f"{name}.{kind}_scale"] = scale.detach().cpu().to(getattr(torch, dtype))
    return scales


def _collect_scales(scales: dict[str, Any], per_sample: dict[tuple[str, str], np.ndarray],
                    observer: str) -> list[dict[str, Any]]:
    """Per-layer scales, absmax and convergence; refuse scales that are non-finite, <= 0
    or, for the running-absmax observer, different from the absmax our own hooks saw."""
    import torch

    layers: dict[str, dict[str, Any]] = {}
    for tensor_name, tensor in scales.items():
        name, kind = tensor_name.rsplit(".", 1)[0], tensor_name[-len("k_scale"):][0]
        scale = tensor.float().flatten()
        seen = torch.from_numpy(per_sample[(name, kind)].max(axis=0))
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise CheckFailed(f"{tensor_name} came out {scale.tolist()}: not finite and "
                              "positive; nothing was saved")
        if bool((seen == 0).any()):
            raise CheckFailed(f"{tensor_name}: every {kind} value seen was 0 (absmax per head "
                              f"{seen.tolist()}), so no scale can be measured; nothing was saved")
        expected = (seen if scale.numel() > 1 else seen.max().reshape(1)) / E4M3_MAX
        if observer == "static_minmax" and not torch.allclose(scale, expected, rtol=SCALE_RTOL):
            raise CheckFailed(f"{tensor_name} is {scale.tolist()}, but the absmax seen gives "
                              f"{expected.tolist()}; nothing was saved")
        entry = layers.setdefault(name, {"layer": layer_index(name), "module": name})
        entry[f"{kind}_scale"] = scale.tolist()
        entry[f"{kind}_absmax"] = seen.tolist()
        entry[f"{kind}_convergence"] = convergence.per_scale(per_sample[(name, kind)],
                                                             per_head=scale.numel() > 1)
    return sorted(layers.values(), key=lambda e: e["layer"])


def _quantization_config(model, compressed: bool = False) -> dict[str, Any]:
    """The quantization_config llm-compressor itself would write for this model; dense
    unless its weights were quantized here (`compressed`)."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    config = QuantizationConfig.from_pretrained(model)
    if not compressed:
        config.format = "dense"
    config.quantization_status = QuantizationStatus.COMPRESSED
    result = config.model_dump(mode="json")
    result["version"] = compressed_tensors.__version__
    return result


def write_checkpoint(out: Path, source: Checkpoint, scales: dict[str, Any],
                     quant_config: dict[str, Any], recipe_yaml: str,
                     weights: str = "copy") -> None:
    """Copy the input checkpoint into `out`, add the scales, and point config and index at them.

    Weights are placed as `weights` says (copy, clone or hard link; see kvcalib.weights),
    except that scale tensors of an earlier calibration are dropped (see copy_weights).
    """
    from safetensors.torch import save_file

    weight_map = copy_weights(out, source.folder, weights=weights)
    save_file({k: v.contiguous() for k, v in scales.items()}, out / SCALES_FILE,
              metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(scales, SCALES_FILE))
    write_index(out, weight_map)
    write_config(out, source.config, quant_config)
    (out / "recipe.yaml").write_text(recipe_yaml)


def copy_weights(out: Path, model_dir: Path, leave_out: tuple[str, ...] = (),
                 weights: str = "copy") -> dict[str, str]:
    """Copy every file of `model_dir` but its config, index and calibration outputs (and
    `leave_out`) into `out`; return the weight map of the copied tensors.

    Weight files are placed as `weights` says, byte for byte; a file that holds KV scale
    tensors is rewritten without them. A lone
    model.safetensors becomes a one-shard file, because transformers ignores the index
    when model.safetensors exists.
    """
    files = checkpoint.weight_files(model_dir)
    copy_side_files(out, model_dir, leave_out)
    weight_map: dict[str, str] = {}
    for src in files:
        name = "model-00001-of-00001.safetensors" if src == "model.safetensors" else src
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        tensors = checkpoint.file_tensors(model_dir, src)
        found, twice = layouts.find_scales(tensors)
        old_scales = {s.info.name for s in found} | set(twice)
        if old_scales:
            checkpoint.copy_tensors(model_dir, src, out / name, drop=old_scales)
        else:
            weight_files.place(model_dir / src, out / name, weights)
        weight_map.update({t: name for t in tensors if t not in old_scales})
    return weight_map


def copy_side_files(out: Path, model_dir: Path, leave_out: tuple[str, ...] = ()) -> None:
    """Copy what is not weights, config, index or calibration output (tokenizer, generation
    config...) from `model_dir` into `out`, but `leave_out`."""
    for item in model_dir.iterdir():
        if item.suffix == ".safetensors" or item.name in (checkpoint.INDEX_NAME, REPORT_FILE,
                                                          "recipe.yaml", "config.json",
                                                          *leave_out):
            continue
        copy = shutil.copytree if item.is_dir() else shutil.copyfile
        copy(item, out / item.name)


def write_quantized_checkpoint(out: Path, model_dir: Path, model, scales: dict[str, Any],
                               dtype: str, recipe_yaml: str) -> dict[str, Any]:
    """Save a model whose weights this run quantized (`run --scheme`), compressed by
    compressed-tensors, in the input's dtype; return the quantization_config it wrote.

    The KV scales are saved with the model; each must be the one measured.
    """
    import torch
    from safetensors import safe_open

    model.to(getattr(torch, dtype))
    model.save_pretrained(out, save_compressed=True)
    copy_side_files(out, model_dir)  # the input's tokenizer and generation config
    saved_tensors = checkpoint.tensor_index(out)
    for name, expected in scales.items():
        with safe_open(saved_tensors[name].file, "pt") as saved:
            if not torch.equal(saved.get_tensor(name), expected):
                raise CheckFailed(f"{name}: the saved scale is not the one measured; "
                                  "nothing was saved")
    (out / "recipe.yaml").write_text(recipe_yaml)
    return checkpoint.load_config(out)["quantization_config"]


def write_index(out: Path, weight_map: dict[str, str]) -> None:
    total = sum((out / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": total},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / checkpoint.INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def write_config(out: Path, config: dict[str, Any], quant_config: dict[str, Any]) -> None:
    """The input's `config` with `quant_config` as its quantization_config."""
    config = {**config, "quantization_config": quant_config}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _versions() -> dict[str, str]:
    packages = ("kvcalib", "llmcompressor", "compressed-tensors", "transformers", "torch",
                "datasets")
    versions = {}
    for package in packages:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    versions["python"] = sys.version.split()[0]
    return versions
