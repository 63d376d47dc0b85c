"""What `kvcalib eval` returns: metrics per configuration, the probes' results and the
checks a pipeline gates on."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvcalib.checks import Check, exit_code
from kvcalib.evaluate.metrics import Metrics


@dataclass
class EvalResult:
    checkpoint: str
    samples: dict[str, Any]
    reference_ppl: float
    metrics: dict[str, Metrics]
    notes: list[str] = field(default_factory=list)
    verdict: str = ""
    passkey: dict[str, Any] | None = None
    sweep: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None
    kivi: dict[str, Any] | None = None
    formats: dict[str, Any] | None = None  # --formats: rows, recommendation, top two
    layer_scales: dict[str, Any] = field(default_factory=dict)  # layers, largest k/v scale
    checks: list[Check] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return exit_code(self.checks)

    def to_dict(self) -> dict[str, Any]:
        result = asdict(self)
        result["exit_code"] = self.exit_code
        return result
