"""Checks, the exit code they imply, and CommandResult: the one interface of every
command's result, which the CLI's output sink takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

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


class CommandResult:
    """What a command returns: its `checks` (a field or a property of each result; a
    result that checks nothing has none), the exit code they imply, its JSON form and its
    summary for people. `suite` names its checks' JUnit test suite."""

    suite: ClassVar[str] = ""
    checks: list[Check]

    @property
    def exit_code(self) -> int:
        return exit_code(self.checks)

    def to_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        """The result read back from its JSON form, each value checked against its field's
        type (pydantic validates the dataclass); a ValueError when it is not one."""
        from pydantic import TypeAdapter

        return TypeAdapter(cls).validate_python(data)

    def summary(self) -> str:
        raise NotImplementedError
