"""`kvcalib verify`'s summary: the checks table and the verdict."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcalib.engine.targets import serving_table
from kvcalib.tables import checks_table, result_line

if TYPE_CHECKING:
    from kvcalib.verify.run import VerifyResult


def verify_summary(result: VerifyResult) -> str:
    """The checks, then where it serves (its checks are that table, so not repeated)."""
    checks = [c for c in result.checks if c.group != "serving"]
    return "\n".join([f"Checkpoint: {result.checkpoint}", checks_table(checks),
                      *([serving_table(result.serving)] if result.serving else []),
                      result_line(result.exit_code)])
