"""`kvcalib inspect`'s and `kvcalib convert`'s summaries."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcalib.dtypes import E4M3_MAX
from kvcalib.tables import table
from kvcalib.text import index_ranges, value_range

if TYPE_CHECKING:
    from kvcalib.checkpoint.convert import Conversion
    from kvcalib.checkpoint.inspect import Inspection


def inspect_summary(result: Inspection, heads: bool = False) -> str:
    """A row per layer (scales as min..max over heads); with `heads`, a row per head too."""
    lines = [f"Checkpoint: {result.checkpoint}",
             f"Scheme: {result.layout}, strategy {result.strategy}, "
             f"{'/'.join(result.kinds)} scales on {len(result.layers)} attention layers",
             _calibration_line(result.calibration),
             "Median layer: " + ", ".join(
                 f"{k}_scale {m:.4g} (absmax {m * E4M3_MAX:.4g})"
                 for k, m in result.median.items()), ""]
    headers = ["layer"]
    for kind in result.kinds:
        headers += [f"{kind}_scale", f"{kind} absmax", f"{kind} x median"]
    rows = []
    for layer in result.layers:
        row: list[Any] = [layer.layer]
        for kind in result.kinds:
            scales = layer.kinds.get(kind)
            row += ([value_range(scales.scale), max(scales.absmax), round(max(scales.ratio), 2)]
                    if scales else ["-", "-", "-"])
        rows.append([*row, _flags(result.outliers, layer.layer)])
    lines.append(table([*headers, "flags"], rows))
    if heads and result.strategy == "attn_head":
        lines += ["", table(["layer", "kind", "head", "scale", "absmax", "x median",
                             "seen absmax"], _head_rows(result))]
    lines.append("")
    lines.append(f"Outliers (x median above {result.outlier_ratio:g} or below "
                 f"1/{result.outlier_ratio:g}) and clipping: "
                 f"{len(result.outliers) or 'none'}")
    lines += [f"Note: {note}" for note in result.notes]
    lines += [f"Problem: {problem}" for problem in result.problems]
    return "\n".join(lines)


def _flags(outliers: list[dict[str, Any]], layer: int) -> str:
    """One layer's outliers, heads of one kind and reason together: 'v x0.07..0.11 (heads
    0-2)', 'k clips (head 1)'."""
    groups: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for outlier in outliers:
        if outlier["layer"] == layer:
            clips = outlier["why"].startswith("clips")
            groups.setdefault((outlier["kind"], clips), []).append(outlier)
    flags = []
    for (kind, clips), items in groups.items():
        ratios = [item["ratio"] for item in items]
        what = "clips" if clips else "x" + value_range(ratios, ".2f")
        heads = [item["head"] for item in items if item["head"] is not None]
        which = f" (head{'s' if len(heads) > 1 else ''} {index_ranges(heads)})" if heads else ""
        flags.append(f"{kind} {what}{which}")
    return "; ".join(flags)


def _head_rows(result: Inspection) -> list[list[Any]]:
    rows = []
    for layer in result.layers:
        for kind, scales in layer.kinds.items():
            for head, scale in enumerate(scales.scale):
                seen = scales.seen_absmax[head] if scales.seen_absmax else None
                rows.append([layer.layer, kind, head, f"{scale:.4g}", f"{scales.absmax[head]:.4g}",
                             f"{scales.ratio[head]:.2f}", "-" if seen is None else f"{seen:.4g}"])
    return rows


def _calibration_line(calibration: dict[str, Any] | None) -> str:
    from kvcalib.checkpoint.calibration_report import REPORT_FILE

    if calibration is None:
        return f"Calibration: no {REPORT_FILE} in the checkpoint"
    dataset, samples = calibration.get("dataset", {}), calibration.get("samples", {})
    observer = calibration.get("scheme", {}).get("observer", "?")
    return (f"Calibration: {dataset.get('source', '?')}"
            f"{' ' + dataset['split'] if dataset.get('split') else ''}, "
            f"{samples.get('used', '?')} samples x <= {samples.get('max_seq_len', '?')} tokens "
            f"({samples.get('num_tokens', '?')} tokens), observer {observer}, "
            f"kvcalib {calibration.get('kvcalib_version', '?')} on "
            f"{calibration.get('created', '?')}")




def convert_summary(result: Conversion) -> str:
    values = [max(v) for v in result.scales.values()]
    lines = [f"Converted {result.source} ({result.source_layout}) to {result.target_layout}: "
             f"{len(result.scales)} {result.strategy} scales "
             f"({value_range(values)})", f"Checkpoint: {result.output}"]
    return "\n".join(lines + [f"Note: {note}" for note in result.notes])
