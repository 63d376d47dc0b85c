"""Rendering results for people (aligned tables) and for pipelines (JSON, JUnit XML)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table; numbers right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    numeric = [all(isinstance(row[i], (int, float)) for row in rows) for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric, strict=True)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, cells)])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def scale_range(values: Sequence[float]) -> str:
    """One scale, or min..max over heads."""
    lo, hi = min(values), max(values)
    return f"{lo:.4g}" if lo == hi else f"{lo:.4g}..{hi:.4g}"


def calibration_summary(report: dict[str, Any]) -> str:
    kinds = [k for k in ("k", "v", "q") if f"{k}_scale" in report["layers"][0]]
    headers = ["layer", *(f"{k}_scale" for k in kinds), *(f"{k} absmax" for k in kinds)]
    rows = [[layer["layer"], *(scale_range(layer[f"{k}_scale"]) for k in kinds),
             *(f"{max(layer[f'{k}_absmax']):.4g}" for k in kinds)]
            for layer in report["layers"]]
    samples, timings = report["samples"], report["timings_s"]
    footer = (f"{samples['used']} samples x <= {samples['max_seq_len']} tokens "
              f"({samples['num_tokens']} tokens), strategy {report['scheme']['strategy']}, "
              f"observer {report['scheme']['observer']}, pipeline {report['pipeline']['used']}; "
              f"load {timings['load']:.1f}s, calibrate {timings['calibrate']:.1f}s, "
              f"save {timings['save']:.1f}s")
    return table(headers, rows) + "\n" + footer


def write_json(path: Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")
