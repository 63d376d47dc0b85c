"""Every vLLM KV format side by side (eval --formats): each sized at a memory budget by
kvcalib.kvcache.capacity, simulated with its own math, compared with calibrated FP8 by
paired intervals, and the one with the most tokens that meets the gates recommended."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

from kvcalib import stats
from kvcalib.checkpoint.read import Checkpoint
from kvcalib.dtypes import E4M3_MAX
from kvcalib.evaluate.metrics import Metrics, compare_to, difference
from kvcalib.evaluate.options import EvalOptions, Formats, Gates
from kvcalib.evaluate.result import EvalResult
from kvcalib.kvcache import capacity, simulate
from kvcalib.kvcache import formats as kv_formats

REFERENCE_FORMAT = "auto"  # the model dtype: what every format is sized against


@dataclass
class FormatRow:
    """One row of the format comparison: a vLLM --kv-cache-dtype with one choice of static
    scales, its capacity, and (unless n/a) its metrics under `metrics_key`."""

    label: str
    format: str
    scales: str  # "calibrated", "scale 1.0", "dynamic", or "" (the model dtype)
    runs_on: dict[str, str]  # target -> attention backend
    bytes_per_token: float | None = None  # every attention layer full, kept layers 16-bit
    tokens_at_budget: int | None = None
    metrics_key: str | None = None  # in EvalResult.metrics; None: n/a or the model dtype
    note: str = ""
    vs_reference: dict[str, Any] | None = None  # paired differences from calibrated FP8
    passkey: float | None = None
    meets_gates: bool | None = None  # None: no gate set


def format_names(formats: Formats) -> list[str]:
    """--formats (all, or vLLM kv_cache_dtype names, to which auto and fp8 are added: the
    model dtype and the reference configuration are always rows), filtered to the target."""
    if formats.names == ["all"]:
        names = [name for name in kv_formats.FORMATS if name != "fp8_e4m3"]  # an alias of fp8
    else:
        names = list(dict.fromkeys([REFERENCE_FORMAT, "fp8", *formats.names]))
    return [name for name in names if formats.target is None
            or formats.target in kv_formats.FORMATS[name].runs_on]


def nvfp4_scales(own: dict[int, dict[str, Any]], kv_cache_dtype: str) -> dict[int, dict[str, Any]]:
    """Per-tensor NVFP4 global scales from the calibration, as ModelOpt exports them: the
    absmax the FP8 scale implies (scale · 448, the largest head), over 6 · block ceiling."""
    import torch

    return {layer: {kind: torch.tensor(kv_formats.nvfp4_global_scale(
        float(scale.max()) * E4M3_MAX, kv_cache_dtype)) for kind, scale in kinds.items()
        if kind in ("k", "v")} for layer, kinds in own.items()}


def plan_rows(ckpt: Checkpoint, own: dict[int, dict[str, Any]], options: EvalOptions,
         known: dict[tuple[str, str], str]
         ) -> tuple[list[FormatRow], dict[str, simulate.Simulation]]:
    """The rows, sized by kvcalib.kvcache.capacity (vLLM's page accounting), and the
    simulations still to score: static formats with the checkpoint's scales and at 1.0,
    except the FP8 configurations `known` already scores ((element type, scales) -> metrics
    key)."""
    formats, kinds, rounding = options.formats, ckpt.kinds, options.rounding
    names = format_names(formats)
    est = capacity.from_config(ckpt.config, capacity.EstimateOptions(
        context_length=options.held_out.max_seq_len, budget=formats.budget,
        block_size=formats.blocks, formats=names))
    sizes = dict(zip(names, est.formats, strict=True))
    shape = ckpt.geometry
    rows, sims = [], {}
    for name in names:
        fmt, size = kv_formats.FORMATS[name], sizes[name]
        base = FormatRow(name, name, "", fmt.runs_on, size.bytes_per_token, size.tokens_fit)
        reason = fmt.unsupported(shape.cache_shape(), formats.target)
        if reason:
            rows.append(dataclasses.replace(base, label=name, note=f"n/a: {reason}"))
            continue
        if not fmt.quantized:
            rows.append(base)
            continue
        layers = kv_formats.quantized_layers(fmt, shape.attention_layers, shape.num_layers,
                                             shape.hybrid)
        variants: dict[str, dict[int, dict[str, Any]]] = {"dynamic": {}}
        if fmt.static_scales == "fp8":
            variants = {"calibrated": own, "scale 1.0": {}} if own else {"scale 1.0": {}}
        elif fmt.static_scales == "nvfp4":
            variants = {"scale 1.0": {}}
            if own:
                variants = {"calibrated": nvfp4_scales(own, name), **variants}
        for scales_name, scales in variants.items():
            sim = simulate.Simulation(format=fmt, rounding=rounding, scales=scales,
                                      kinds=kinds if fmt.fp8 else ("k", "v"), layers=layers,
                                      count_clipping=bool(fmt.fp8))
            label = name if scales_name == "dynamic" else f"{name} ({scales_name})"
            key = known.get((fmt.fp8 or "", scales_name), label)
            if key == label:
                sims[label] = sim
            note = size.note
            if fmt.static_scales == "nvfp4" and scales_name == "calibrated":
                note = ("global scales absmax / (6 x block max), as ModelOpt exports; this "
                        "checkpoint stores FP8 scales, which vLLM would read as the global "
                        "scale")
            rows.append(dataclasses.replace(base, label=label, scales=scales_name,
                                            metrics_key=key, note=note))
    return rows, sims


def meets_gates(row: FormatRow, metrics: dict[str, Metrics], reference_passkey: float | None,
                gates: Gates) -> bool | None:
    """Whether a row passes every gate set (None: none set, or the row is n/a). The model
    dtype is the reference itself: KL 0, no perplexity change, the reference's passkey."""
    if not gates.any_set or row.note.startswith("n/a"):
        return None
    m = metrics.get(row.metrics_key or "")
    kl, ppl_change = (m.mean_kl, m.ppl_change) if m else (0.0, 0.0)
    return gates.met(kl, ppl_change, row.passkey if m else reference_passkey)


def recommend(rows: list[FormatRow], metrics: dict[str, Metrics]) -> FormatRow | None:
    """The row with the most tokens at the budget among those that meet the gates (ties:
    the lower mean KL); None when no gate is set."""
    passing = [row for row in rows if row.meets_gates]
    if not passing:
        return None
    return max(passing, key=lambda row: (row.tokens_at_budget or 0,
                                         -metrics[row.metrics_key].mean_kl
                                         if row.metrics_key else 0.0))


def top_two(rows: list[FormatRow], metrics: dict[str, Metrics]) -> dict[str, Any] | None:
    """The two quantized rows with the lowest mean KL: does the first beat the second, and
    how many samples would tell them apart?"""
    ranked = sorted((row for row in rows if row.metrics_key),
                    key=lambda row: metrics[row.metrics_key].mean_kl)
    ranked = list({row.metrics_key: row for row in reversed(ranked)}.values())[::-1]
    if len(ranked) < 2 or stats.too_few(len(metrics[ranked[0].metrics_key].kl_by_sample)):
        return None
    first, second = ranked[:2]
    found = stats.paired_bootstrap(metrics[first.metrics_key].kl_pairs(),
                                   metrics[second.metrics_key].kl_pairs(), stats.ratio_of_sums)
    return {"first": first.label, "second": second.label, **difference(found)}


def compare(rows: list[FormatRow], result: EvalResult, reference: str, gates: Gates,
            formats: Formats) -> dict[str, Any]:
    """Fill in each row's statistics and gates, then rank."""
    metrics = result.metrics
    passkey = result.passkey or {}
    reference_passkey = passkey["reference"]["accuracy"] if passkey else None
    for row in rows:
        if row.metrics_key:
            if row.metrics_key != reference:
                row.vs_reference = compare_to(metrics[reference], metrics[row.metrics_key])
            if row.metrics_key in passkey:
                row.passkey = passkey[row.metrics_key]["accuracy"]
        elif not row.note.startswith("n/a"):
            row.passkey = reference_passkey
        row.meets_gates = meets_gates(row, metrics, reference_passkey, gates)
    best = recommend(rows, metrics)
    return {"target": formats.target, "budget_bytes": formats.budget_bytes,
            "block_size": formats.blocks,
            "reference": reference, "gates": asdict(gates),
            "rows": [asdict(row) for row in rows],
            "recommendation": None if best is None else {
                "label": best.label, "format": best.format,
                "tokens_at_budget": best.tokens_at_budget,
                "quantized": best.metrics_key is not None,
                "flag": f"--kv-cache-dtype {best.format}"},
            "top_two": top_two(rows, metrics)}


