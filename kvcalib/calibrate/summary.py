"""`kvcalib run`'s summary: the scales per layer and what the pass took."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcalib.tables import table
from kvcalib.text import value_range

if TYPE_CHECKING:
    from kvcalib.checkpoint.calibration_report import CalibrationReport


def calibration_summary(report: CalibrationReport) -> str:
    kinds = [k for k in ("k", "v", "q") if getattr(report.layers[0], f"{k}_scale") is not None]
    headers = ["layer", *(f"{k}_scale" for k in kinds), *(f"{k} absmax" for k in kinds)]
    rows = [[layer.layer, *(value_range(getattr(layer, f"{k}_scale")) for k in kinds),
             *(f"{max(getattr(layer, f'{k}_absmax')):.4g}" for k in kinds)]
            for layer in report.layers]
    samples, timings = report.samples, report.timings_s
    footer = (f"{samples.used} samples x <= {samples.max_seq_len} tokens "
              f"({samples.num_tokens} tokens), strategy {report.scheme.strategy}, "
              f"observer {report.scheme.observer}, pipeline {report.pipeline.used}, "
              f"{report.compute.attention} attention; "
              f"load {timings['load']:.1f}s, calibrate {timings['calibrate']:.1f}s, "
              f"save {timings['save']:.1f}s")
    return table(headers, rows) + "\n" + footer
