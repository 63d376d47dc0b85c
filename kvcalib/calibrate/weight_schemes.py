"""Weight-quantized checkpoints: which ones `run` calibrates, and `--scheme` presets.

A release that ships an FP8 KV cache usually ships quantized weights too. kvcalib
calibrates the KV scales on the model as it will serve: a compressed-tensors checkpoint
is loaded with its weights decompressed to their quantized values (transformers'
CompressedTensorsConfig(dequantize=True)); its weight files are then copied bit for bit
and only `kv_cache_scheme` is added to its quantization_config.

`--scheme PRESET` instead quantizes an unquantized checkpoint's weights in the same
llm-compressor pass as the KV scales, with compressed-tensors' preset schemes, as
llm-compressor's examples/quantization_kv_cache do.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcalib.errors import UsageError

if TYPE_CHECKING:
    from kvcalib.checkpoint.read import Checkpoint

# compressed-tensors formats whose weights transformers decompresses on the CPU:
# FP8 and INT8 W8A8 (float-/int-quantized), W4A16 and W8A16 (pack-quantized).
SUPPORTED_FORMATS = ("float-quantized", "int-quantized", "pack-quantized", "naive-quantized")
SUPPORTED = (f"compressed-tensors checkpoints with weights in the formats "
             f"{', '.join(SUPPORTED_FORMATS)} (llm-compressor's FP8, FP8_DYNAMIC, W8A8, W4A16...)"
             ", or unquantized ones")
IGNORE = ["lm_head"]  # as upstream's KV example: lm_head stays in the model dtype


def presets() -> list[str]:
    """compressed-tensors' preset scheme names that quantize weights."""
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES

    return [name for name, scheme in PRESET_SCHEMES.items() if scheme.get("weights")]


def check_preset(name: str | None) -> None:
    if name is not None and name not in presets():
        raise UsageError(f"unknown --scheme {name!r}; compressed-tensors' presets are "
                         f"{', '.join(presets())}")


def preset_groups(name: str) -> dict[str, Any]:
    """The config group `--scheme name` applies to every Linear layer (but IGNORE)."""
    from compressed_tensors.quantization import preset_name_to_scheme

    return {"group_0": preset_name_to_scheme(name, ["Linear"])}


def check_fits(model, name: str) -> None:
    """Refuse a grouped preset whose group size does not divide some layer's input
    features (compressed-tensors cannot save or run it), before calibration starts."""
    from compressed_tensors.utils import match_named_modules

    group = preset_groups(name)["group_0"]
    size = group.weights.group_size
    if not size:
        return
    bad = [f"{layer} ({module.in_features})" for layer, module
           in match_named_modules(model, group.targets, IGNORE)
           if module.in_features % size]
    if bad:
        raise UsageError(f"--scheme {name} quantizes weights in groups of {size} input "
                         f"features, which {len(bad)} layers do not divide, e.g. "
                         f"{', '.join(bad[:3])}; choose a scheme without groups (e.g. "
                         "W8A16, FP8_DYNAMIC) or quantize with llm-compressor directly")


def declared_quantization(model_dir: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's quantization_config, refused when it is not a JSON object (transformers
    itself fails on a list or a string with an AttributeError)."""
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise UsageError(f"{model_dir}: config.json's quantization_config must be a JSON "
                         f"object, not {type(quant).__name__}")
    return quant


def input_quantization(ckpt: Checkpoint) -> dict[str, Any] | None:
    """The input's quantization_config when it quantizes weights, None when the checkpoint
    is unquantized or quantizes only the KV cache. A format kvcalib cannot load
    decompressed is refused here, before anything is loaded."""
    from compressed_tensors.quantization import QuantizationConfig
    from pydantic import ValidationError

    from kvcalib.checkpoint.calibration_report import validation_message

    model_dir = ckpt.folder
    quant = declared_quantization(model_dir, ckpt.config or {})
    if not quant:
        return None
    method = quant.get("quant_method")
    if method != "compressed-tensors":
        raise UsageError(f"{model_dir} is quantized with {method!r}, which kvcalib cannot "
                         f"calibrate; it runs {SUPPORTED}")
    try:
        parsed = QuantizationConfig.model_validate({"config_groups": {}, **quant})
    except ValidationError as exc:
        raise UsageError(f"{model_dir}: its compressed-tensors quantization_config is not "
                         f"valid: {validation_message(exc)}") from None
    groups = {name: g for name, g in parsed.config_groups.items() if not isinstance(g, list)}
    if all(not g.weights and not g.output_activations for g in groups.values()):
        return None  # KV (and attention) only: recalibrated like an unquantized checkpoint
    formats = {g.format or parsed.format for g in groups.values() if g.weights}
    problems = [f"format {f!r}" for f in sorted(formats - set(SUPPORTED_FORMATS))]
    problems += [f"output activations quantized ({name})" for name, g in groups.items()
                 if g.output_activations]
    problems += [f"{key} {quant[key]}" for key in ("sparsity_config", "transform_config")
                 if quant.get(key)]
    if problems:
        raise UsageError(f"{model_dir} is a compressed-tensors checkpoint with "
                         f"{'; '.join(problems)}, which kvcalib cannot calibrate; "
                         f"it runs {SUPPORTED}")
    return quant


def load_options(quant: dict[str, Any] | None) -> dict[str, Any]:
    """from_pretrained options: weights decompressed to their quantized values, so that
    the KV cache is measured on the weights vLLM will serve."""
    if quant is None:
        return {}
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


def with_kv_scheme(quant: dict[str, Any], calibrated: dict[str, Any],
                   attention_classes: list[str] | None) -> dict[str, Any]:
    """The input's quantization_config, unchanged but for the calibrated kv_cache_scheme
    (and, with q_scale, the attention group): its weight groups, ignore and format stay."""
    merged = copy.deepcopy(quant)
    merged["kv_cache_scheme"] = calibrated["kv_cache_scheme"]
    for name, group in calibrated["config_groups"].items():
        if attention_classes and set(group["targets"]) <= set(attention_classes):
            taken = set(merged.setdefault("config_groups", {}))
            merged["config_groups"][name if name not in taken else f"kv_{name}"] = group
    return merged


def report(quant: dict[str, Any], quantized_by: str, preset: str | None) -> dict[str, Any]:
    """What the calibration report says about the weights (schema.WeightQuantizationInfo)."""
    return {"quantized_by": quantized_by, "preset": preset, "format": quant.get("format"),
            "config_groups": {name: group for name, group in quant["config_groups"].items()
                              if isinstance(group, dict) and group.get("weights")},
            "ignore": list(quant.get("ignore") or [])}


def weights_line(info: dict[str, Any] | None) -> str:
    """One line on the weights for `run`'s summary."""
    if info is None:
        return "unquantized, copied bit for bit"
    schemes = ", ".join(_scheme_name(group) for group in info["config_groups"].values())
    how = (f"quantized here with --scheme {info['preset']}" if info["quantized_by"] == "run"
           else "quantized in the input, copied bit for bit")
    return (f"{schemes} ({info['format']}), {how}; ignored: "
            f"{', '.join(info['ignore']) or 'none'}")


def _scheme_name(group: dict[str, Any]) -> str:
    """W8A8 int / W4A16 int... from a config group's weight and input activation args."""
    weights, inputs = group["weights"], group.get("input_activations")
    activations = f"A{inputs['num_bits']}" if inputs else "A16"
    kind = "fp" if weights["type"] == "float" else weights["type"]
    return f"W{weights['num_bits']}{activations} {kind}{weights['num_bits']}"
