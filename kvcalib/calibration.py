"""Calibrate FP8 KV-cache scales with llm-compressor and write a release-ready checkpoint.

llm-compressor measures the scales (QuantizationModifier with a kv_cache_scheme). This
module chooses what it gets wrong by default and writes the output itself:

- observer: the true running absmax (`static_minmax`), not the EMA default, which
  measured up to 42% low on SmolLM2 and clips the largest keys and values;
- q_scale: llm-compressor 0.14.0.1 forces eager attention while calibrating, which
  bypasses compressed-tensors' hooked attention, so q is never observed and q_scale is
  saved as uninitialized memory. `_observe_queries` keeps the hooked attention;
- output: the input's weight files are copied byte for byte and the scales are added
  in their own file, so every weight is bit-identical to the input;
- our own hooks record the absmax of every K/V/Q tensor in float32, so each scale is
  checked against what was really seen before anything is written.
"""

from __future__ import annotations

import contextlib
import datetime
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

from kvcalib import checkpoint, data, geometry, layouts
from kvcalib.errors import CheckFailed, UsageError
from kvcalib.schema import REPORT_FILE, REPORT_SCHEMA_VERSION

# llm-compressor logs INFO lines and a CPU warning per stage; keep its errors only,
# unless the user asks for more.
os.environ.setdefault("LLM_COMPRESSOR_LOG_LEVEL", "ERROR")

STRATEGIES = ("tensor", "attn_head")
OBSERVERS = ("static_minmax", "minmax", "mse")
PIPELINES = ("auto", "basic", "sequential")
DTYPES = ("auto", "bfloat16", "float16", "float32")
FP8_E4M3_MAX = 448.0
SCALES_FILE = "kv_scales.safetensors"
# A measured absmax and its stored scale may differ by the rounding of the model dtype.
SCALE_RTOL = 2**-7


@dataclass
class CalibrationResult:
    """Where the checkpoint went and what was measured (the content of the report)."""

    output: Path
    report: dict[str, Any]

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
    overwrite: bool = False,
    log: Callable[[str], None] = _stderr,
) -> CalibrationResult:
    """Measure FP8 KV scales of `model` on `dataset` and write `output` atomically."""
    _check_choice("strategy", strategy, STRATEGIES)
    _check_choice("observer", observer, OBSERVERS)
    _check_choice("pipeline", pipeline, PIPELINES)
    _check_choice("dtype", dtype, DTYPES)
    data.check_sample_args(num_samples, max_seq_len)  # before any slow step
    dataset = dataset or data.DatasetSpec()
    started = time.perf_counter()

    model_dir = checkpoint.resolve_model(str(model))
    target = checkpoint.check_output_target(Path(output), model_dir, overwrite)
    config = _check_causal_lm(model_dir)

    log(f"Loading {model_dir}")
    tokenizer = _load_tokenizer(model_dir)
    samples = data.select_samples(dataset, tokenizer, num_samples, max_seq_len, seed)
    if len(samples.token_ids) < num_samples:
        log(f"Only {len(samples.token_ids)} usable samples in {dataset.source} "
            f"(asked for {num_samples}); calibrating on those.")
    torch_model, compute = _load_model(model_dir, dtype)
    attention = _attention_modules(torch_model, config)
    chosen_pipeline, reason = _choose_pipeline(pipeline, torch_model, max_seq_len, compute)
    load_s = time.perf_counter() - started

    log(f"Calibrating {len(attention)} attention layers on {len(samples.token_ids)} samples "
        f"({samples.num_tokens} tokens), strategy {strategy}, observer {observer}, "
        f"pipeline {chosen_pipeline} ({reason}), {compute['dtype']} on {compute['device']}")
    attention_classes = _attention_classes(attention) if q_scale else None
    modifier = build_modifier(strategy, observer, attention_classes)
    t0 = time.perf_counter()
    absmax = _run_oneshot(torch_model, modifier, samples, max_seq_len, chosen_pipeline, attention,
                          q_scale)
    calibrate_s = time.perf_counter() - t0

    kinds = ("k", "v", "q") if q_scale else ("k", "v")
    scales = _scale_tensors(attention, kinds, compute["checkpoint_dtype"])
    layers = _collect_scales(scales, absmax, observer)
    quant_config = _quantization_config(torch_model)
    t0 = time.perf_counter()
    report = {
        "schema_version": REPORT_SCHEMA_VERSION,
        "kvcalib_version": metadata.version("kvcalib"),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": {"source": str(model), "path": str(model_dir),
                  "architecture": (config.get("architectures") or ["?"])[0],
                  "model_type": config.get("model_type")},
        "scheme": {"num_bits": 8, "type": "float", "format": "float8_e4m3fn",
                   "fp8_max": FP8_E4M3_MAX, "strategy": strategy, "q_scale": q_scale,
                   "observer": observer},
        "dataset": {**samples.dataset, "rows_used": samples.rows},
        "samples": {"requested": num_samples, "used": len(samples.token_ids),
                    "max_seq_len": max_seq_len, "num_tokens": samples.num_tokens, "seed": seed},
        "pipeline": {"requested": pipeline, "used": chosen_pipeline, "reason": reason},
        "compute": compute,
        "versions": _versions(),
        "timings_s": {"load": round(load_s, 3), "calibrate": round(calibrate_s, 3)},
        "layers": layers,
    }
    log(f"Writing {target}")
    with checkpoint.atomic_output_dir(target, overwrite) as tmp:
        write_checkpoint(tmp, model_dir, scales, quant_config, _recipe_yaml(modifier))
        report["timings_s"]["save"] = round(time.perf_counter() - t0, 3)
        report["timings_s"]["total"] = round(time.perf_counter() - started, 3)
        (tmp / REPORT_FILE).write_text(json.dumps(report, indent=1) + "\n")
    return CalibrationResult(target, report)


def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"unknown {what} {value!r}; choose one of {', '.join(choices)}")


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
    quant = config.get("quantization_config")
    if quant and not _is_kv_only(quant):
        raise UsageError(f"{model_dir} is already quantized ({quant.get('quant_method')}); "
                         "kvcalib calibrates unquantized checkpoints")
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


def _is_kv_only(quant: dict[str, Any]) -> bool:
    """A compressed-tensors config that only quantizes the KV cache (and attention)."""
    groups = quant.get("config_groups") or {}
    return quant.get("quant_method") == "compressed-tensors" and all(
        not g.get("weights") and not g.get("output_activations") for g in groups.values()
    )


def _load_model(model_dir: Path, dtype: str):
    """Load for calibration. Eager attention: llm-compressor calibrates under it anyway."""
    import torch
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    stored = _checkpoint_dtype(model_dir)
    if dtype == "auto":
        # bf16/fp16 matmuls without native CPU support run several times slower than fp32.
        native_half = device == "cuda" or torch.cpu._is_avx512_bf16_supported()
        dtype = stored if native_half or stored == "float32" else "float32"
    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=getattr(torch, dtype), attn_implementation="eager"
        )
    except Exception as exc:  # transformers raises many types for unloadable models
        raise UsageError(f"cannot load {model_dir} as a causal LM: "
                         f"{str(exc).splitlines()[0]}") from None
    model.eval()
    return model, {"device": device, "dtype": dtype, "checkpoint_dtype": stored}


def _checkpoint_dtype(model_dir: Path) -> str:
    """The floating dtype most weight bytes are stored in; scales are saved in it."""
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    sizes: dict[str, int] = {}
    for info in checkpoint.tensor_index(model_dir).values():
        if info.dtype in names:
            sizes[info.dtype] = sizes.get(info.dtype, 0) + info.end - info.start
    if not sizes:
        raise UsageError(f"{model_dir} has no bf16, fp16 or fp32 weights to calibrate")
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


def _choose_pipeline(requested: str, model, max_seq_len: int,
                     compute: dict[str, str]) -> tuple[str, str]:
    """`basic` when the model and one sample's activations fit the device, else sequential."""
    if requested != "auto":
        return requested, "requested"
    import torch

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config.get_text_config()
    # Eager attention holds one (heads x seq x seq) fp32 matrix per layer at a time.
    activations = 4 * cfg.num_attention_heads * max_seq_len**2 + 64 * max_seq_len * cfg.hidden_size
    on_gpu = compute["device"] == "cuda"
    free = torch.cuda.mem_get_info()[0] if on_gpu else _available_host_memory()
    need = params + activations
    if need < 0.8 * free:
        return "basic", f"needs ~{need / 2**30:.1f} GiB of {free / 2**30:.1f} GiB free"
    return "sequential", f"~{need / 2**30:.1f} GiB does not fit {free / 2**30:.1f} GiB free"


def _available_host_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def kv_quantization_args(strategy: str, observer: str):
    """FP8 E4M3, static, symmetric: the only KV scheme vLLM loads from compressed-tensors."""
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=8, type="float", strategy=strategy, dynamic=False,
                            symmetric=True, observer=observer)


def build_modifier(strategy: str, observer: str, attention_classes: list[str] | None):
    """The llm-compressor modifier; with attention classes it also calibrates q_scale."""
    from compressed_tensors.quantization import QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    args = kv_quantization_args(strategy, observer)
    groups = None
    if attention_classes:
        groups = {"attention": QuantizationScheme(targets=attention_classes,
                                                  input_activations=args)}
    return QuantizationModifier(ignore=["lm_head"], kv_cache_scheme=args, config_groups=groups)


def _recipe_yaml(modifier) -> str:
    from llmcompressor.recipe import Recipe

    return Recipe.from_modifiers([modifier]).yaml()


class _AbsmaxRecorder:
    """Per-head absmax of the post-RoPE states llm-compressor's observers see."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, str], Any] = {}

    def hook(self, name: str, kind: str) -> Callable:
        import torch

        def record(_module, states):  # states: (batch, heads, seq, head_dim)
            amax = states.detach().abs().amax(dim=(0, 2, 3)).float().cpu()
            old = self.values.get((name, kind))
            self.values[(name, kind)] = amax if old is None else torch.maximum(old, amax)

        return record


def _run_oneshot(model, modifier, samples: data.Samples, max_seq_len: int, pipeline: str,
                 attention: dict[str, Any], q_scale: bool) -> _AbsmaxRecorder:
    from compressed_tensors.modeling import (
        initialize_hooked_attention,
        initialize_hooked_kv_cache,
        register_key_hook,
        register_query_hook,
        register_value_hook,
    )
    from datasets import Dataset
    from llmcompressor import oneshot

    recorder = _AbsmaxRecorder()
    handles = []
    for name, module in attention.items():
        # The same hook points llm-compressor attaches its observers to (idempotent).
        if q_scale:
            initialize_hooked_attention(model, module)
            handles.append(register_query_hook(module, recorder.hook(name, "q")))
        initialize_hooked_kv_cache(model, module)
        handles.append(register_key_hook(module, recorder.hook(name, "k")))
        handles.append(register_value_hook(module, recorder.hook(name, "v")))
    rows = Dataset.from_dict({"input_ids": samples.token_ids,
                              "attention_mask": [[1] * len(ids) for ids in samples.token_ids]})
    context = _observe_queries(attention) if q_scale else contextlib.nullcontext()
    try:
        with context:
            oneshot(model=model, dataset=rows, recipe=[modifier], max_seq_length=max_seq_len,
                    num_calibration_samples=len(samples.token_ids), pipeline=pipeline,
                    shuffle_calibration_samples=False, batch_size=1)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        raise CheckFailed(f"calibration failed in llm-compressor: {type(exc).__name__}: "
                          f"{exc}") from exc
    finally:
        for handle in handles:
            handle.remove()
    return recorder


@contextlib.contextmanager
def _observe_queries(attention: dict[str, Any]) -> Iterator[None]:
    """Let llm-compressor observe queries (see the module docstring).

    Keep compressed-tensors' hooked attention in place during calibration instead of
    llm-compressor's forced eager attention, and give the hooked attention the model's
    own eager function under the name it looks up.
    """
    import llmcompressor.utils.helpers as helpers
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

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


def _collect_scales(scales: dict[str, Any], recorder: _AbsmaxRecorder, observer: str,
                    ) -> list[dict[str, Any]]:
    """Per-layer scales and absmax; refuse scales that are non-finite, <= 0 or, for the
    running-absmax observer, different from the absmax our own hooks saw."""
    import torch

    layers: dict[str, dict[str, Any]] = {}
    for tensor_name, tensor in scales.items():
        name, kind = tensor_name.rsplit(".", 1)[0], tensor_name[-len("k_scale"):][0]
        scale = tensor.float().flatten()
        seen = recorder.values[(name, kind)]
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise CheckFailed(f"{tensor_name} came out {scale.tolist()}: not finite and "
                              "positive; nothing was saved")
        if bool((seen == 0).any()):
            raise CheckFailed(f"{tensor_name}: every {kind} value seen was 0 (absmax per head "
                              f"{seen.tolist()}), so no scale can be measured; nothing was saved")
        expected = (seen if scale.numel() > 1 else seen.max().reshape(1)) / FP8_E4M3_MAX
        if observer == "static_minmax" and not torch.allclose(scale, expected, rtol=SCALE_RTOL):
            raise CheckFailed(f"{tensor_name} is {scale.tolist()}, but the absmax seen gives "
                              f"{expected.tolist()}; nothing was saved")
        entry = layers.setdefault(name, {"layer": layer_index(name), "module": name})
        entry[f"{kind}_scale"] = scale.tolist()
        entry[f"{kind}_absmax"] = seen.tolist()
    return sorted(layers.values(), key=lambda e: e["layer"])


def _quantization_config(model) -> dict[str, Any]:
    """The quantization_config llm-compressor itself would write for this model."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    config = QuantizationConfig.from_pretrained(model)
    config.format = "dense"
    config.quantization_status = QuantizationStatus.COMPRESSED
    result = config.model_dump(mode="json")
    result["version"] = compressed_tensors.__version__
    return result


def write_checkpoint(out: Path, model_dir: Path, scales: dict[str, Any],
                     quant_config: dict[str, Any], recipe_yaml: str) -> None:
    """Copy the input checkpoint into `out`, add the scales, and point config and index at them.

    Weight files are copied byte for byte, except that scale tensors of an earlier
    calibration are dropped (see copy_weights).
    """
    from safetensors.torch import save_file

    weight_map = copy_weights(out, model_dir)
    save_file({k: v.contiguous() for k, v in scales.items()}, out / SCALES_FILE,
              metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(scales, SCALES_FILE))
    write_index(out, weight_map)
    write_config(out, model_dir, quant_config)
    (out / "recipe.yaml").write_text(recipe_yaml)


def copy_weights(out: Path, model_dir: Path, leave_out: tuple[str, ...] = ()) -> dict[str, str]:
    """Copy every file of `model_dir` but its config, index and calibration outputs (and
    `leave_out`) into `out`; return the weight map of the copied tensors.

    Weight files are copied byte for byte, without the KV scale tensors they hold. A lone
    model.safetensors becomes a one-shard file, because transformers ignores the index
    when model.safetensors exists.
    """
    files = checkpoint.weight_files(model_dir)
    for item in model_dir.iterdir():
        if item.suffix == ".safetensors" or item.name in (checkpoint.INDEX_NAME, REPORT_FILE,
                                                          "recipe.yaml", "config.json",
                                                          *leave_out):
            continue
        copy = shutil.copytree if item.is_dir() else shutil.copyfile
        copy(item, out / item.name)
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
            shutil.copyfile(model_dir / src, out / name)
        weight_map.update({t: name for t in tensors if t not in old_scales})
    return weight_map


def write_index(out: Path, weight_map: dict[str, str]) -> None:
    total = sum((out / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": total},
             "weight_map": dict(sorted(weight_map.items()))}
    (out / checkpoint.INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def write_config(out: Path, model_dir: Path, quant_config: dict[str, Any]) -> None:
    """The input's config.json with `quant_config` as its quantization_config."""
    config = checkpoint.load_config(model_dir)
    config["quantization_config"] = quant_config
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
