"""`kvcalib lm-eval`'s summary: accuracy per configuration, the paired comparisons, the
verdict."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvcalib.tables import result_line, right_aligned, table

if TYPE_CHECKING:
    from kvcalib.lmeval.result import LmEvalResult


def lm_eval_summary(result: LmEvalResult) -> str:
    """Accuracy per task and length (95% bootstrap interval), per needle depth, the paired
    comparisons and the recovery verdict."""
    opts = result.options
    lines = [f"Checkpoint: {result.checkpoint}",
             f"Tasks: {', '.join(opts['tasks'])}; lengths {', '.join(map(str, opts['lengths']))};"
             f" {opts['limit']} examples per task and length"]
    lines += [f"{c.name}: not scored: {c.reason}" for c in result.configs if not c.ran]
    rows = [[r["config"], r["task"], str(r["length"] or "-"), str(r["n"]),
             _accuracy_cell(r)] for r in result.table()]
    if rows:
        headers = ["config", "task", "length", "n", "accuracy [95% CI]"]
        lines += ["", table(headers, right_aligned(headers, rows))]
    depth = result.depth_table()
    if depth:
        configs = list(dict.fromkeys(r["config"] for r in depth))
        cells = {(r["length"], r["depth"], r["config"]): r for r in depth}
        keys = sorted({(r["length"], r["depth"]) for r in depth},
                      key=lambda k: (k[0], int(k[1].split("-")[0])))
        headers = ["length", "needle depth", *configs]
        rows = [[str(length), bucket, *(
            f"{cells[length, bucket, c]['accuracy']:.0%} of {cells[length, bucket, c]['n']}"
            if (length, bucket, c) in cells else "-" for c in configs)]
            for length, bucket in keys]
        lines += ["", "By needle depth (RULER tasks together):",
                  table(headers, right_aligned(headers, rows))]
    comparisons = result.comparisons()
    if comparisons:
        headers = ["b vs a", "pairs", "only a right", "only b right", "McNemar p",
                   "accuracy b - a [95% CI]", "verdict"]
        rows = [[f"{c['b']} vs {c['a']}", str(c["n"]), str(c["only_a"]), str(c["only_b"]),
                 f"{c['p_value']:.3g}", _difference_cell(c), c["verdict"]]
                for c in comparisons]
        lines += ["", table(headers, right_aligned(headers, rows))]
    lines += ["", *result.verdict(), *result.notes, result_line(result.exit_code)]
    return "\n".join(line for line in lines if line is not None)


def _accuracy_cell(row: dict[str, Any]) -> str:
    if row["low"] is None:
        return f"{row['accuracy']:.1%} (too few to tell)"
    return f"{row['accuracy']:.1%} [{row['low']:.1%}, {row['high']:.1%}]"


def _difference_cell(row: dict[str, Any]) -> str:
    if row["difference"] is None:
        return "-"
    if row["low"] is None:
        return f"{row['difference']:+.1%}"
    return f"{row['difference']:+.1%} [{row['low']:+.1%}, {row['high']:+.1%}]"
