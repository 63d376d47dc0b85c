"""`kvcalib verify`'s summary: the checks table and the verdict."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcalib.tables import checks_table, result_line

if TYPE_CHECKING:
    from kvcalib.verify.run import VerifyResult


def verify_summary(result: VerifyResult) -> str:
    return "\n".join([f"Checkpoint: {result.checkpoint}", checks_table(result.checks),
                      result_line(result.exit_code)])
