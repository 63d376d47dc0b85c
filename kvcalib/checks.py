"""Check results shared by `verify` and `eval`, and the exit code they imply."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PASS, FAIL, ERROR, SKIP, WARN = "pass", "fail", "error", "skip", "warn"


@dataclass
class Check:
    """One verified fact. `layer`, `tensor` and `value` say exactly what was looked at.

    `group` gathers checks for the summary table (scheme, scales, readback, gate, ...).
    """

    group: str
    status: str
    message: str
    layer: int | None = None
    tensor: str | None = None
    value: Any = None


def exit_code(checks: list[Check]) -> int:
    """1 when a check failed, else 2 when one could not run, else 0."""
    statuses = {c.status for c in checks}
    return 1 if FAIL in statuses else 2 if ERROR in statuses else 0
