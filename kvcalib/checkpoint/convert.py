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
from typing import Any, ClassVar

import numpy as np

from kvcalib.checkpoint import layouts
from kvcalib.checkpoint.calibration_report import REPORT_FILE
from kvcalib.checkpoint.read import Checkpoint, open_checkpoint
from kvcalib.checkpoint.safetensors import RawTensor, decode
from kvcalib.checkpoint.summary import convert_summary
from kvcalib.checkpoint.write import RECIPE_FILE, write_checkpoint
from kvcalib.checks import FAIL, WARN, Check, CommandResult
from kvcalib.dtypes import BY_TORCH_NAME, DTYPES
from kvcalib.errors import UsageError
from kvcalib.writes import atomic_output_dir, check_output_target


@dataclass
class Conversion(CommandResult):
    checks: ClassVar[list[Check]] = []  # checks nothing: exit code 0

    source: str
    output: str
    source_layout: str
    target_layout: str
    strategy: str  # of the written scales
    scales: dict[str, list[float]]  # tensor name -> values written
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return convert_summary(self)


def convert(source: str | Path, to: str | None, output: str | Path, overwrite: bool = False,
            strategy: str | None = None) -> Conversion:
    """Write `source` with its KV scales in format `to` (None: its own) and `strategy`
    (None: its own, where `to` keeps per-head scales, else tensor) to `output` (atomically).

    Per-head scales become per-tensor ones by their largest head: FP8 rounding is monotone,
    so that is exactly the scale a per-tensor calibration on the same samples stores."""
    if to is not None and to not in layouts.TARGETS:
        raise UsageError(f"unknown format {to!r}; convert writes {', '.join(layouts.TARGETS)}")
    if strategy not in (None, "tensor", "attn_head"):
        raise UsageError(f"unknown strategy {strategy!r}; choose one of tensor, attn_head")
    folder = Path(source)
    ckpt, checks = open_checkpoint(folder)  # a missing folder is a UsageError
    scheme = _convertible(ckpt, checks)
    to = to or scheme.layout
    layout = layouts.LAYOUTS[to]
    strategy = _target_strategy(folder, scheme, to, strategy)
    target = check_output_target(Path(output), folder, overwrite)
    notes = [c.message for c in checks if c.group == "measurement" and c.status == WARN]
    if strategy != scheme.strategy:
        why = (f"{to} has one scale per layer" if not layout.per_head else
               "what a per-tensor calibration on the same samples stores")
        notes.append(f"{scheme.strategy} scales became per-tensor ones, the largest head's: "
                     f"{why}")
    if scheme.quantizes_query:
        notes.append("q scales were left out: kvcalib converts k and v scales only")
    left_out = [name for name in (REPORT_FILE, RECIPE_FILE) if (folder / name).exists()]
    if left_out:
        notes.append(f"{' and '.join(left_out)} (the source's calibration) were left out")
    dtype = layout.scale_dtype
    if dtype == "model":
        model_dtype = BY_TORCH_NAME.get(ckpt.geometry.dtype)
        dtype = model_dtype.name if model_dtype and model_dtype.name != "F64" else "F32"
    scales: dict[str, RawTensor] = {
        name: (dtype, shape, _encode(values, dtype))
        for name, (shape, values) in _target_scales(ckpt, layout, strategy).items()}
    config_files = tuple(name for each in layouts.LAYOUTS.values() for name in each.config_files)
    with atomic_output_dir(target, overwrite) as tmp:
        write_checkpoint(tmp, ckpt, scales, layout.kv_only_config(strategy, ckpt.tensors),
                         leave_out=config_files)
    return Conversion(str(folder.resolve()), str(target), scheme.layout, to, strategy,
                      {name: decode(raw, dtype).tolist()
                       for name, (dtype, _, raw) in scales.items()}, notes)


def _target_strategy(folder: Path, scheme: layouts.KvScheme, to: str,
                     strategy: str | None) -> str:
    """The strategy of the written scales, or a usage error saying why it cannot be."""
    per_head = layouts.LAYOUTS[to].per_head
    chosen = strategy or (scheme.strategy if per_head else "tensor")
    if chosen == "attn_head" and scheme.strategy != "attn_head":
        raise UsageError(f"{folder} has per-tensor scales: one scale per layer cannot become "
                         "one per head; calibrate with --strategy attn_head")
    if chosen == "attn_head" and not per_head:
        raise UsageError(f"{to} has one KV scale per layer, no per-head scales; convert with "
                         "--strategy tensor (the largest head's)")
    if (to, chosen) == (scheme.layout, scheme.strategy):
        raise UsageError(f"{folder} is already a {to} checkpoint with {chosen} scales")
    return chosen


def _convertible(ckpt: Checkpoint, checks: list) -> layouts.KvScheme:
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
    if scheme.layout not in layouts.TARGETS:
        raise UsageError(f"{folder} is a {scheme.layout} checkpoint; convert reads "
                         f"{', '.join(layouts.TARGETS)}")
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


def _target_scales(ckpt: Checkpoint, layout: layouts.ScaleLayout, strategy: str
                   ) -> dict[str, tuple[tuple[int, ...], np.ndarray]]:
    """name -> (shape, values) of every k and v scale in the target's naming."""
    modules = {scale.layer: scale.module for scale in layouts.find_scales(ckpt.tensors)[0]}
    scales = {}
    for (layer, kind), scale in ckpt.scales.items():
        if kind not in ("k", "v"):
            continue
        values = scale.values if strategy == "attn_head" else np.array([scale.values.max()])
        name = layout.scale_name.format(module=modules[layer], kind=kind)
        scales[name] = (layout.scale_shape(strategy, values.size), values)
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
