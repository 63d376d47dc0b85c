"""`kvcalib inspect`: what a checkpoint's KV scales look like, by layer and by head.

Reads what `verify` reads statically (config, declared scheme, the scale tensors; never
the weights, no engine), so it works on every layout verify knows, and the calibration
report (kvcalib_report.json) when the checkpoint has one. For each scale it shows:
- absmax: scale × 448, the largest |K|, |V| or |Q| that FP8 E4M3 represents with it;
- ×median: the scale over the median layer's scale of the same kind, where a layer's scale
  is its largest head's (the one backends without per-head scales use);
- outliers: ×median above `outlier_ratio` or below its inverse. A layer far from the others
  saw unusual activations, or the calibration data missed what it sees in serving;
- clipping: with a report, an absmax seen while calibrating above the one the scale
  represents (an averaging observer such as minmax): larger values are clipped.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from kvcalib.checkpoint.calibration_report import REPORT_FILE, CalibrationReport
from kvcalib.checkpoint.read import KINDS, KvScales, open_checkpoint
from kvcalib.checkpoint.summary import inspect_summary
from kvcalib.checks import FAIL, WARN, Check, CommandResult
from kvcalib.choices import OUTLIER_RATIO
from kvcalib.dtypes import E4M3_MAX
from kvcalib.errors import UsageError


@dataclass
class KindScales:
    """One layer's scales of one kind: one value per head, or a single per-tensor value."""

    scale: list[float]
    absmax: list[float]
    ratio: list[float]  # to the median layer's scale
    seen_absmax: list[float] | None = None  # from the report


@dataclass
class LayerScales:
    layer: int
    kinds: dict[str, KindScales] = field(default_factory=dict)


@dataclass
class Inspection(CommandResult):
    checks: ClassVar[list[Check]] = []  # checks nothing: exit code 0

    checkpoint: str
    layout: str
    strategy: str
    kinds: list[str]
    median: dict[str, float]  # the median layer's scale, per kind
    outlier_ratio: float
    layers: list[LayerScales]
    outliers: list[dict[str, Any]]  # layer, kind, head (None: per-tensor), scale, ratio, why
    calibration: dict[str, Any] | None  # from the report
    problems: list[str]  # failed static checks and report mismatches, shown alongside
    notes: list[str] = field(default_factory=list)  # where the scales were measured

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self, heads: bool = False) -> str:
        """With `heads`, a row per head too."""
        return inspect_summary(self, heads)


def inspect(folder: str | Path, outlier_ratio: float = OUTLIER_RATIO) -> Inspection:
    """Every scale the static checks could read, with its absmax, ratio and flags."""
    if outlier_ratio <= 1:
        raise UsageError(f"outlier ratio must be above 1, not {outlier_ratio}")
    folder = Path(folder)
    ckpt, checks = open_checkpoint(folder)
    problems = [c.message for c in checks if c.status == FAIL]
    if ckpt.scheme is None or not ckpt.scales:
        reason = problems[0] if problems else "no KV scale tensors were found"
        raise UsageError(f"{folder}: no KV scales to inspect: {reason}")
    kinds = ckpt.scales.kinds()
    median = {k: float(np.median([scale.values.max() for (_, kind), scale in
                                  ckpt.scales.items() if kind == k])) for k in kinds}
    report = ckpt.report
    seen = _seen_absmax(report)
    layers: dict[int, LayerScales] = {}
    for (index, kind), scale in ckpt.scales.items():
        values = scale.values
        scales = KindScales(values.tolist(), (values * E4M3_MAX).tolist(),
                            (values / median[kind]).tolist(), _per_value(seen, index, kind,
                                                                         values.size))
        layers.setdefault(index, LayerScales(index)).kinds[kind] = scales
    if report is not None:
        problems += _report_mismatches(report, ckpt.scales)
    result = Inspection(str(folder.resolve()), ckpt.scheme.layout, ckpt.scheme.strategy,
                        kinds, median, outlier_ratio, list(layers.values()), [],
                        _calibration(report), problems,
                        [c.message for c in checks if c.group == "measurement" and
                         c.status == WARN])
    result.outliers = _outliers(result, ckpt.scales)
    return result


def _seen_absmax(report: CalibrationReport | None) -> dict[tuple[int, str], list[float]]:
    if report is None:
        return {}
    return {(entry.layer, kind): getattr(entry, f"{kind}_absmax") for entry in report.layers
            for kind in KINDS if getattr(entry, f"{kind}_absmax") is not None}


def _per_value(seen: dict[tuple[int, str], list[float]], layer: int, kind: str,
               size: int) -> list[float] | None:
    """The report records absmax per head; a per-tensor scale covers their largest."""
    values = seen.get((layer, kind))
    if values is None:
        return None
    if len(values) == size:
        return list(values)
    return [max(values)] if size == 1 else None


def _report_mismatches(report: CalibrationReport, stored: KvScales) -> list[str]:
    """A report from another run (or an edited checkpoint) must not be read as this one's."""
    wrong = []
    for (layer, kind), reported in KvScales.from_report(report).items():
        scale = stored.get(layer, kind)
        if scale is None:
            continue
        if reported.values.shape != scale.values.shape or not np.allclose(
                reported.values, scale.values, rtol=scale.rtol):
            wrong.append(f"layer {layer} {kind}")
    if not wrong:
        return []
    return [f"{REPORT_FILE} disagrees with the scale tensors at {len(wrong)} scales "
            f"({', '.join(wrong[:5])}{', ...' if len(wrong) > 5 else ''}): it does not "
            "describe this checkpoint's scales"]


def _calibration(report: CalibrationReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    keys = {"kvcalib_version", "created", "model", "scheme", "dataset", "samples", "pipeline"}
    return report.model_dump(mode="json", include=keys)


def _outliers(result: Inspection, stored: KvScales) -> list[dict[str, Any]]:
    found = []
    per_head = result.strategy == "attn_head"
    for layer in result.layers:
        for kind, scales in layer.kinds.items():
            # A stored scale may round down by one step of its dtype below absmax / 448.
            rtol = 2 * stored.get(layer.layer, kind).rtol
            for head, (scale, ratio) in enumerate(zip(scales.scale, scales.ratio, strict=True)):
                where = {"layer": layer.layer, "kind": kind, "head": head if per_head else None,
                         "scale": scale, "ratio": ratio}
                if ratio > result.outlier_ratio or ratio < 1 / result.outlier_ratio:
                    found.append({**where, "why": f"{ratio:.2f}x the median layer"})
                seen = scales.seen_absmax[head] if scales.seen_absmax else None
                if seen is not None and seen > scales.absmax[head] * (1 + rtol):
                    found.append({**where, "why": f"clips: calibration saw |{kind}| up to "
                                  f"{seen:.4g}, the scale represents {scales.absmax[head]:.4g}"})
    return found
