"""Were there enough samples? The running absmax of every scale, sample after sample.

kvcalib's hooks record each sample's absmax per layer, kind (k, v, q) and head. From
them, per scale: its running absmax (kept as the samples where it rose: the whole curve,
in a few numbers), the sample at which it reached its final value, and how much it grew
over the last half of the samples. A scale that still grew late would likely grow with
more samples, so layers where one grew by more than 5% are flagged.

Sample numbers count from 1 in the order of the report's `dataset.rows_used`, which is
the order kvcalib feeds the samples (on several ranks too).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcalib.checkpoint.calibration_report import CalibrationReport

LATE_GROWTH = 0.05
FLAG_NOTE = "more samples may raise this scale"


def scale_convergence(per_sample: np.ndarray) -> dict[str, Any]:
    """One scale's convergence from its per-sample absmax (1-D, in sample order)."""
    running = np.maximum.accumulate(np.asarray(per_sample, dtype=np.float64))
    rises = [0, *np.flatnonzero(running[1:] > running[:-1]) + 1]
    half = len(running) // 2
    growth = float(running[-1] / running[half - 1] - 1) if half and running[half - 1] > 0 else None
    return {"steps": [[int(i) + 1, float(running[i])] for i in rises],
            "reached_at": int(rises[-1]) + 1,
            "last_half_growth": growth}


def per_scale(per_sample: np.ndarray, per_head: bool) -> list[dict[str, Any]]:
    """Convergence of each stored scale: one per head (attn_head) or one per layer
    (tensor, the largest head). `per_sample` is (samples, heads)."""
    columns = per_sample if per_head else per_sample.max(axis=1, keepdims=True)
    return [scale_convergence(columns[:, h]) for h in range(columns.shape[1])]


def flagged(layers: list[dict[str, Any]], kinds: tuple[str, ...]) -> list[dict[str, Any]]:
    """Layers and kinds where a scale grew by more than LATE_GROWTH in the last half."""
    found = []
    for layer in layers:
        for kind in kinds:
            growth = [s["last_half_growth"] or 0.0 for s in layer[f"{kind}_convergence"]]
            if max(growth) > LATE_GROWTH:
                heads = [h for h, g in enumerate(growth) if g > LATE_GROWTH]
                found.append({"layer": layer["layer"], "kind": kind,
                              "last_half_growth": max(growth),
                              "heads": heads if len(growth) > 1 else None})
    return found


def late_growth(found: list[dict[str, Any]], scales: int, samples: int) -> str:
    """One line for the log: which layers' scales still grew late."""
    by_kind: dict[str, list[str]] = {}
    for flag in found:
        by_kind.setdefault(flag["kind"], []).append(
            f"{flag['layer']} (+{flag['last_half_growth']:.0%})")
    where = "; ".join(f"{kind}: layers {', '.join(items)}" for kind, items in by_kind.items())
    return (f"{len(found)} of {scales} layer scales grew by more than {LATE_GROWTH:.0%} over "
            f"the last half of the {samples} samples ({where}): more samples may raise "
            "these scales")


def running_absmax(steps: list[tuple[int, float]], samples: int) -> np.ndarray:
    """The running absmax after each of `samples` samples, from its steps."""
    curve = np.empty(samples)
    starts = [int(s) - 1 for s, _ in steps] + [samples]
    for (_, value), start, end in zip(steps, starts, starts[1:], strict=False):
        curve[start:end] = value
    return curve


def layer_curves(report: CalibrationReport) -> dict[str, dict[int, np.ndarray]]:
    """Per kind, per layer: running absmax ÷ final after each sample (largest head)."""
    samples = report.samples.used
    curves: dict[str, dict[int, np.ndarray]] = {}
    for layer in report.layers:
        for kind in ("k", "v", "q"):
            scales = getattr(layer, f"{kind}_convergence")
            if scales:
                running = np.max([running_absmax(s.steps, samples) for s in scales], axis=0)
                curves.setdefault(kind, {})[layer.layer] = running / running[-1]
    return curves
