"""`kvcalib convert`: give a checkpoint's FP8 KV scales another format's tensor names and
config, for teams that calibrate with one tool and serve another format.

- Every tensor but the KV scales is copied byte for byte (kvcalib.checkpoint.write); the
  scales are written anew, in the target's names, shapes and dtype, in their own file.
- quantization_config becomes a KV-only config of the target format, written as vLLM
  0.32's loader for it needs (kvcalib.checkpoint.layouts), which is not always what the tool
  itself writes: ModelOpt 0.47 leaves quant_algo out of KV-only exports, and Quark 0.13's
  KV-only exports keep the KV config where vLLM does not read it.
- Only checkpoints with unquantized weights: one quantization_config describes weights and
  KV cache in one format, and convert does not touch the weights.
- A per-head scale, in a format that has per-tensor scales only (ModelOpt, Quark), becomes
  the largest head's, which bounds every head. A scale stored in a narrower dtype is
  rounded up, so that it still covers the absmax it was measured for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvcalib.checkpoint import layouts
from kvcalib.checkpoint.calibration_report import REPORT_FILE
from kvcalib.checkpoint.read import Checkpoint, open_checkpoint
from kvcalib.checkpoint.safetensors import RawTensor, TensorInfo, decode
from kvcalib.checkpoint.write import RECIPE_FILE, write_checkpoint
from kvcalib.checks import FAIL, WARN
from kvcalib.dtypes import BY_TORCH_NAME, DTYPES
from kvcalib.errors import UsageError
from kvcalib.writes import atomic_output_dir, check_output_target

TARGETS = tuple(layouts.SCALE_NAMES)
# The dtype each format's own tool stores KV scales in ("model": the model's dtype).
SCALE_DTYPES = {"compressed-tensors": "model", "modelopt": "F32", "quark": "model"}
FP8_KV = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False,
          "symmetric": True, "ch_axis": None, "group_size": None, "round_method": "half_even",
          "scale_type": "float", "observer_cls": "PerTensorMinMaxObserver"}
NO_QUANTIZATION = {"weight": None, "input_tensors": None, "output_tensors": None,
                   "bias": None, "target_device": None}


@dataclass
class Conversion:
    source: str
    output: str
    source_layout: str
    target_layout: str
    strategy: str  # of the written scales
    scales: dict[str, list[float]]  # tensor name -> values written
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def convert(source: str | Path, to: str, output: str | Path,
            overwrite: bool = False) -> Conversion:
    """Write `source` with its KV scales in format `to` to `output` (atomically)."""
    if to not in TARGETS:
        raise UsageError(f"unknown format {to!r}; convert writes {', '.join(TARGETS)}")
    folder = Path(source)
    ckpt, checks = open_checkpoint(folder)  # a missing folder is a UsageError
    scheme = _convertible(ckpt, checks, to)
    target = check_output_target(Path(output), folder, overwrite)
    notes = [c.message for c in checks if c.group == "measurement" and c.status == WARN]
    strategy = scheme.strategy if to == "compressed-tensors" else "tensor"
    if strategy != scheme.strategy:
        notes.append(f"{scheme.strategy} scales became per-tensor ones, the largest head's: "
                     f"{to} has one scale per layer")
    if scheme.quantizes_query:
        notes.append("q scales were left out: kvcalib converts k and v scales only")
    left_out = [name for name in (REPORT_FILE, RECIPE_FILE) if (folder / name).exists()]
    if left_out:
        notes.append(f"{' and '.join(left_out)} (the source's calibration) were left out")
    dtype = SCALE_DTYPES[to]
    if dtype == "model":
        model_dtype = BY_TORCH_NAME.get(ckpt.geometry.dtype)
        dtype = model_dtype.name if model_dtype and model_dtype.name != "F64" else "F32"
    scales: dict[str, RawTensor] = {
        name: (dtype, shape, _encode(values, dtype))
        for name, (shape, values) in _target_scales(ckpt, to, strategy).items()}
    with atomic_output_dir(target, overwrite) as tmp:
        write_checkpoint(tmp, ckpt, scales, _quantization_config(to, strategy, ckpt.tensors),
                         leave_out=(layouts.MODELOPT_LEGACY_FILE,))
    return Conversion(str(folder.resolve()), str(target), scheme.layout, to, strategy,
                      {name: decode(raw, dtype).tolist()
                       for name, (dtype, _, raw) in scales.items()}, notes)


def _convertible(ckpt: Checkpoint, checks: list, to: str) -> layouts.KvScheme:
    """The source's scheme, once its KV scales are known readable and its weights plain."""
    folder = ckpt.folder
    failed = {c.group: c.message for c in reversed(checks) if c.status == FAIL}
    for group in ("config", "weights", "layers"):
        if group in failed:
            raise UsageError(f"cannot convert {folder}: {failed[group]}")
    scheme = ckpt.scheme
    if scheme is None:
        reason = failed.get("scheme", "it declares no KV-cache quantization")
        raise UsageError(f"{folder} has no KV scales to convert: {reason}")
    if scheme.layout not in TARGETS:
        raise UsageError(f"{folder} is a {scheme.layout} checkpoint; convert reads "
                         f"{', '.join(TARGETS)}")
    if scheme.layout == to:
        raise UsageError(f"{folder} is already a {to} checkpoint")
    if not scheme.fp8:
        raise UsageError(f"{folder} declares a KV cache other than FP8 E4M3 "
                         f"({scheme.declared}); convert moves FP8 scales only")
    if "scales" in failed:
        raise UsageError(f"{folder}: its KV scales do not pass verify: {failed['scales']}")
    quantized = layouts.quantized_weights(ckpt.tensors)
    if quantized:
        raise UsageError(f"{folder} has quantized weights (e.g. {quantized[0]}); one "
                         "quantization_config describes weights and KV cache in one format, "
                         "and convert rewrites only the KV part, so it converts checkpoints "
                         "whose weights are not quantized")
    return scheme


def _target_scales(ckpt: Checkpoint, to: str, strategy: str
                   ) -> dict[str, tuple[tuple[int, ...], np.ndarray]]:
    """name -> (shape, values) of every k and v scale in the target's naming."""
    modules = {scale.layer: scale.module for scale in layouts.find_scales(ckpt.tensors)[0]}
    scales = {}
    for (layer, kind), scale in ckpt.scales.items():
        if kind not in ("k", "v"):
            continue
        values = scale.values
        name = layouts.SCALE_NAMES[to].format(module=modules[layer], kind=kind)
        if strategy == "attn_head":
            scales[name] = ((values.size, 1, 1), values)
        else:
            shape = (1,) if to == "compressed-tensors" else ()
            scales[name] = (shape, np.array([values.max()]))
    return scales


def _encode(values: np.ndarray, dtype: str) -> bytes:
    """Little-endian bytes of positive `values` in `dtype`, each rounded up to the next
    representable value when it is not exact."""
    if dtype == "BF16":
        bits = np.asarray(values, dtype="<f4").view("<u4")
        high = (bits >> 16).astype("<u2")
        high += decode(high.tobytes(), "BF16") < values
        return high.tobytes()
    numpy_dtype = DTYPES[dtype].numpy
    stored = np.asarray(values, dtype=numpy_dtype)
    stored = np.where(stored < values, np.nextafter(stored, np.inf, dtype=numpy_dtype), stored)
    return stored.astype(numpy_dtype).tobytes()


def _quantization_config(to: str, strategy: str,
                         tensors: dict[str, TensorInfo]) -> dict[str, Any]:
    """A KV-only quantization_config of format `to`, as vLLM 0.32 loads it."""
    if to == "compressed-tensors":
        # Quark and ModelOpt both keep the running absmax, as static_minmax does.
        return layouts.kv_only_config(layouts.kv_cache_args(strategy, "static_minmax"))
    if to == "modelopt":
        # vLLM refuses a ModelOpt config without quant_algo (ModelOpt's own KV-only export):
        # FP8 with every module excluded is its way to say "weights not quantized".
        return {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["*"],
                "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}
    # Quark: vLLM needs the KV output_tensors in layer_quant_config, and every linear layer
    # excluded (it has no scheme for unquantized ones); the scales were taken after RoPE.
    linear = sorted({name.removesuffix(".weight") for name, info in tensors.items()
                     if name.endswith(".weight") and len(info.shape) == 2} | {"lm_head"})
    kv_layer = {**NO_QUANTIZATION, "output_tensors": FP8_KV}
    return {"quant_method": "quark", "global_quant_config": NO_QUANTIZATION,
            "layer_quant_config": {"*k_proj": kv_layer, "*v_proj": kv_layer},
            "layer_type_quant_config": {}, "exclude": linear, "algo_config": None,
            "softmax_quant_spec": None, "quant_mode": "eager_mode", "kv_cache_post_rope": True,
            "export": {"kv_cache_group": ["*k_proj", "*v_proj"], "min_kv_scale": 0.0,
                       "pack_method": "reorder", "weight_format": "real_quantized",
                       "weight_merge_groups": None}}
