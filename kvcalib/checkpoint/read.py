"""A checkpoint's KV side, opened once: its config and shape, the KV scheme it declares, its
tensor index, every KV scale (validated as it is read) and its calibration report.

verify, eval, inspect and convert all open a checkpoint here, so each file is read and
validated in one place. `open_checkpoint` also returns the static checks that reading
produced, which `verify` reports. Only headers and scale tensors are read, never the
weights, and nothing is written to the folder.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcalib.checkpoint import expected, layouts
from kvcalib.checkpoint.calibration_report import CalibrationReport, load_report
from kvcalib.checkpoint.safetensors import TensorInfo, read_tensor, tensor_index, weight_files
from kvcalib.checks import FAIL, PASS, WARN, Check
from kvcalib.dtypes import DTYPES, E4M3_MAX, FLOATS
from kvcalib.errors import KvcalibError, UsageError
from kvcalib.kvcache import geometry
from kvcalib.reads import load_config
from kvcalib.text import index_ranges, value_range

if TYPE_CHECKING:
    from torch import Tensor

KINDS = ("k", "v", "q")
# A scale times 448 is the largest |K|, |V| or |Q| it represents. Real activations stay
# far inside these bounds; values outside are uninitialized memory or a unit mix-up.
MIN_PLAUSIBLE_ABSMAX = 1e-6
MAX_PLAUSIBLE_ABSMAX = 1e6
SMALLEST_NORMAL_FP32 = 2.0**-126  # smaller non-zero values are denormals (1e-39 and such)


@dataclass(frozen=True, eq=False)  # arrays have no single truth value
class Scale:
    """One layer's k, v or q scale: a single value per tensor, or one per head."""

    values: np.ndarray  # float64
    dtype: str = "F64"  # the safetensors dtype it is stored in

    @property
    def rtol(self) -> float:
        """How far another reading of this scale (vLLM's, the report's) may differ."""
        return DTYPES[self.dtype].rtol


@dataclass(frozen=True)
class KvScales:
    """Every valid KV scale of a checkpoint, by (layer, kind). Converters to other shapes
    live here only: from safetensors (`open_checkpoint`), the report and to torch."""

    by_key: Mapping[tuple[int, str], Scale] = field(default_factory=dict)

    def get(self, layer: int, kind: str) -> Scale | None:
        return self.by_key.get((layer, kind))

    def items(self) -> list[tuple[tuple[int, str], Scale]]:
        """(layer, kind) and scale, by layer then kind."""
        return sorted(self.by_key.items(), key=lambda item: item[0])

    def kinds(self) -> list[str]:
        return [kind for kind in KINDS if any(k == kind for _, k in self.by_key)]

    def __len__(self) -> int:
        return len(self.by_key)

    @classmethod
    def from_report(cls, report: CalibrationReport) -> KvScales:
        """The scales the calibration report says it saved."""
        return cls({(entry.layer, kind): Scale(np.asarray(values, dtype=np.float64))
                    for entry in report.layers for kind in KINDS
                    if (values := getattr(entry, f"{kind}_scale")) is not None})

    def to_torch(self) -> dict[int, dict[str, Tensor]]:
        """float32 tensors by layer and kind, as kvcalib.kvcache.simulate applies them."""
        import torch

        scales: dict[int, dict[str, Tensor]] = {}
        for (layer, kind), scale in self.by_key.items():
            scales.setdefault(layer, {})[kind] = torch.tensor(scale.values, dtype=torch.float32)
        return scales


@dataclass(frozen=True)
class Checkpoint:
    """What `open_checkpoint` could read; a field it could not read is None or empty, and
    the checks say why."""

    folder: Path
    config: dict[str, Any] | None = None
    geometry: geometry.Geometry | None = None
    scheme: layouts.KvScheme | None = None
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    scales: KvScales = field(default_factory=KvScales)
    weight_files: tuple[str, ...] = ()  # the safetensors files a loader reads

    @cached_property
    def report(self) -> CalibrationReport | None:
        """The calibration report, validated when first asked for: verify does not read it,
        so a broken report fails only the commands that use it."""
        return load_report(self.folder)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The scales each attention layer should carry."""
        return self.scheme.kinds if self.scheme else ("k", "v")


def open_model(folder: Path, config: dict[str, Any] | None = None) -> Checkpoint:
    """A model to calibrate or copy: its config and tensor index; what cannot be read is
    raised (a CheckpointError), not a check."""
    if config is None:
        config = load_config(folder)
    files = weight_files(folder)
    return Checkpoint(folder, config=config, tensors=tensor_index(folder, files),
                      weight_files=tuple(files))


def open_checkpoint(folder: str | Path) -> tuple[Checkpoint, list[Check]]:
    """Read everything that can be checked without an engine, and the checks it gave."""
    ckpt = Checkpoint(Path(folder))
    if not ckpt.folder.is_dir():
        raise UsageError(f"checkpoint folder not found: {ckpt.folder}")
    try:
        config = load_config(ckpt.folder)
        ckpt = replace(ckpt, config=config, geometry=geometry.geometry(config))
    except KvcalibError as exc:
        return ckpt, [Check("config", FAIL, str(exc))]
    try:
        ckpt = replace(ckpt, scheme=layouts.kv_scheme(ckpt.folder, config))
    except layouts.UnsupportedFormat as exc:
        return ckpt, [Check("scheme", FAIL, f"unsupported checkpoint format: {exc}; kvcalib "
                            "cannot tell whether vLLM loads KV scales from it")]
    except KvcalibError as exc:
        return ckpt, [Check("scheme", FAIL, str(exc))]
    checks = [_scheme_check(ckpt.scheme)]
    if ckpt.scheme is not None and (reason := geometry.unloadable_scales(config)):
        checks.append(Check("scheme", FAIL, f"vLLM will not load these scales: {reason}"))
    try:
        files = weight_files(ckpt.folder)
        ckpt = replace(ckpt, tensors=tensor_index(ckpt.folder, files), weight_files=tuple(files))
    except KvcalibError as exc:
        return ckpt, [*checks, Check("weights", FAIL, str(exc))]
    layer_check = _layers_check(ckpt.geometry, ckpt.tensors)
    if layer_check.status != PASS:
        return ckpt, [*checks, layer_check]
    problems = expected.weight_problems(ckpt.tensors, config)
    if problems:
        checks.append(Check("weights", FAIL, problems.describe(),
                            value=len(problems.missing) + len(problems.unexpected)))
    else:
        checks.append(Check("weights", PASS, f"{len(ckpt.tensors)} tensors in "
                            f"{len({t.file for t in ckpt.tensors.values()})} safetensors "
                            f"files: every weight {problems.source} needs, and no other"))
    checks.append(layer_check)
    found, duplicates = layouts.find_scales(ckpt.tensors)
    checks += [Check("scales", FAIL, f"{name}: a second scale for the same layer and kind",
                     tensor=name) for name in duplicates]
    if ckpt.scheme is not None:
        scale_results, scales = scale_checks(found, ckpt.scheme, ckpt.geometry)
        ckpt = replace(ckpt, scales=scales)
        checks += scale_results + _measurement_notes(ckpt.scheme, scales)
    return ckpt, checks


def _measurement_notes(scheme: layouts.KvScheme, scales: KvScales) -> list[Check]:
    """Where a tool measured the scales, when it is not what the cache stores (warnings:
    vLLM loads them all the same)."""
    notes = []
    if scheme.pre_rope:
        notes.append(Check("measurement", WARN, "keys were measured at k_proj's output, "
                           "before RoPE (Quark's default, kv_cache_post_rope false): the k "
                           "scale does not bound the post-RoPE keys the cache stores, which "
                           "can be larger; calibrate after RoPE (kvcalib run, or Quark's "
                           "kv_cache_post_rope)"))
    pairs = [(scale, scales.get(layer, "v")) for (layer, kind), scale in scales.items()
             if kind == "k"]
    merged = len(pairs) > 1 and all(v is not None and np.array_equal(k.values, v.values)
                                    for k, v in pairs)
    if merged and scheme.layout == "quark":
        notes.append(Check("measurement", WARN, f"k_scale equals v_scale in all {len(pairs)} "
                           "layers: Quark merged k and v into one scale, max(k, v) (it does so "
                           "for its kv_cache_group before RoPE), which is coarser than needed "
                           "for the smaller of the two"))
    return notes


def _layers_check(shape: geometry.Geometry, tensors: dict[str, TensorInfo]) -> Check:
    """The config's attention layers must exist, and the weights must hold each of them: a
    gate that checked no layer must not pass, and a config claiming more layers than the
    files hold is a finding, not a loop over them."""
    attention = shape.attention_layers
    if not attention:
        kinds = ", ".join(sorted({layer.block_type for layer in shape.layers})) or "none"
        return Check("layers", FAIL, f"config.json declares no attention layers "
                     f"({shape.num_layers} layers: {kinds}): there is no KV cache to check")
    scales = {s.info.name for s in layouts.find_scales(tensors)[0]}
    # a layer's KV scales alone are not the layer
    held = {geometry.layer_number(name) for name in set(tensors) - scales} - {None}
    missing = sorted(set(attention) - held)
    if missing:
        return Check("layers", FAIL, f"config.json declares {shape.num_layers} layers, but the "
                     f"weights hold no tensor of attention layers {index_ranges(missing)}",
                     value=len(missing))
    return Check("layers", PASS, f"{len(attention)} attention layers of {shape.num_layers}")


def _scheme_check(scheme: layouts.KvScheme | None) -> Check:
    if scheme is None:
        return Check("scheme", FAIL, "the checkpoint declares no KV-cache quantization "
                     "(no kv_cache_scheme): vLLM would store an FP8 cache with scale 1.0")
    if scheme.problems:
        return Check("scheme", FAIL, "; ".join(scheme.problems), value=scheme.declared)
    query = ", with q_scale" if scheme.quantizes_query else ""
    return Check("scheme", PASS, f"{scheme.layout} FP8 KV cache, strategy "
                 f"{scheme.strategy}{query}", value=scheme.declared)


def _expected_size(kind: str, scheme: layouts.KvScheme, shape: geometry.Geometry) -> int:
    if scheme.strategy != "attn_head":
        return 1
    return shape.num_heads if kind == "q" else shape.num_kv_heads


def scale_checks(tensors: list[layouts.ScaleTensor], scheme: layouts.KvScheme,
                 shape: geometry.Geometry) -> tuple[list[Check], KvScales]:
    """Each attention layer's expected scales, read and checked; the valid ones."""
    by_key: dict[tuple[int, str], layouts.ScaleTensor] = {}
    for tensor in tensors:
        for kind in (("k", "v") if tensor.kind == "kv" else (tensor.kind,)):
            by_key[(tensor.layer, kind)] = tensor
    checks = []
    valid: dict[tuple[int, str], Scale] = {}
    expected_layers = shape.attention_layers
    for layer in expected_layers:
        for kind in scheme.kinds:
            tensor = by_key.get((layer, kind))
            if tensor is None:
                checks.append(Check("scales", FAIL,
                                    f"layer {layer}: no {kind}_scale tensor; vLLM would use 1.0",
                                    layer=layer))
                continue
            check, scale = _value_check(layer, kind, tensor.info,
                                        _expected_size(kind, scheme, shape))
            checks.append(check)
            if scale is not None:
                valid[(layer, kind)] = scale
    for (layer, _), tensor in sorted(by_key.items()):
        if layer not in expected_layers:
            checks.append(Check("scales", WARN, f"{tensor.info.name}: the "
                                f"config has no attention layer {layer}; vLLM ignores it",
                                layer=layer, tensor=tensor.info.name))
    k_and_v = [scale.values for (_, kind), scale in valid.items() if kind in ("k", "v")]
    if k_and_v and all(np.all(values == 1.0) for values in k_and_v):
        checks.append(Check("scales", FAIL, "every k_scale and v_scale is exactly 1.0: "
                            "placeholders, not calibrated values"))
    return checks, KvScales(valid)


def _value_check(layer: int, kind: str, info: TensorInfo,
                 size: int) -> tuple[Check, Scale | None]:
    name = "scales"

    def fail(message: str, value: Any = None) -> tuple[Check, None]:
        return Check(name, FAIL, f"{info.name}: {message}", layer, info.name, value), None

    if info.dtype not in FLOATS:
        return fail(f"dtype {info.dtype} is not floating point", info.dtype)
    count = math.prod(info.shape)
    if count != size:
        want = "a single value" if size == 1 else f"{size} values (one per head)"
        return fail(f"shape {list(info.shape)} holds {count} values; the strategy needs {want}",
                    list(info.shape))
    try:
        values = read_tensor(info).astype(np.float64).ravel()
    except KvcalibError as exc:
        return fail(str(exc))
    listed = values.tolist()
    if not np.all(np.isfinite(values)):
        return fail(f"non-finite value {listed}", listed)
    if np.any(values <= 0):
        return fail(f"value {listed} is not positive", listed)
    if np.any(values < SMALLEST_NORMAL_FP32):
        return fail(f"value {listed} is a denormal: uninitialized memory, not a scale", listed)
    absmax = values * E4M3_MAX
    if np.any(absmax < MIN_PLAUSIBLE_ABSMAX) or np.any(absmax > MAX_PLAUSIBLE_ABSMAX):
        return fail(f"value {listed} means |{kind}| up to {absmax.max():.3g}, outside "
                    f"[{MIN_PLAUSIBLE_ABSMAX:g}, {MAX_PLAUSIBLE_ABSMAX:g}] that real "
                    "activations reach: uninitialized memory or wrong units", listed)
    return (Check(name, PASS, f"{info.name} = {short(listed)}", layer, info.name, listed),
            Scale(values, info.dtype))


def short(values: list[float]) -> str:
    """A scale for one line: its value, or the range over its heads."""
    heads = f" ({len(values)} heads)" if len(values) > 1 else ""
    return value_range(values, ".6g") + heads
