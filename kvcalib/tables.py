"""Tables for people and JUnit XML for CI: the shapes every command's output is made of."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvcalib.checks import Check

Render = Callable[[Sequence[str], Sequence[Sequence[Any]]], str]  # table, markdown_table


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


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table (model cards, docs); a '|' or line break inside a
    cell cannot end it."""
    def line(values: Sequence[Any]) -> str:
        cells = (_cell(v).replace("|", "\\|").replace("\n", " ") for v in values)
        return "| " + " | ".join(cells) + " |"

    return "\n".join([line(headers), "|" + "---|" * len(headers), *map(line, rows)])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def right_aligned(headers: list[str], rows: list[list[str]]) -> list[list[str]]:
    """Pad every column but the first on the left, so numbers line up at the right."""
    widths = [max(len(header), *(len(row[i]) for row in rows))
              for i, header in enumerate(headers)]
    return [[row[0], *(cell.rjust(width) for cell, width in zip(row[1:], widths[1:],
                                                                strict=True))]
            for row in rows]


_STATUS_ORDER = ["fail", "error", "warn", "pass", "skip"]
_SHOWN_PER_GROUP = 6


def checks_table(checks: list[Check]) -> str:
    """One line per check group; failures listed one by one (at most a few per group)."""
    rows = []
    groups: dict[str, list] = {}
    for check in checks:
        groups.setdefault(check.group, []).append(check)
    for group, members in groups.items():
        worst = min((c.status for c in members), key=_STATUS_ORDER.index)
        shown = [c for c in members if c.status == worst]
        if worst in ("pass", "skip") and len(shown) > 1:
            verb = "passed" if worst == "pass" else "skipped"
            rows.append([group, worst, f"{len(shown)} checks {verb}, e.g. {shown[0].message}"])
            continue
        for check in shown[:_SHOWN_PER_GROUP]:
            first, *more = check.message.splitlines() or [""]
            rows.append([group, check.status, first])
            rows += [["", "", f"  {line}"] for line in more]  # e.g. an error's reasons
        if len(shown) > _SHOWN_PER_GROUP:
            rows.append([group, worst, f"... and {len(shown) - _SHOWN_PER_GROUP} more"])
    return table(["check", "status", "detail"], rows)


def result_line(code: int) -> str:
    verdict = {0: "PASS", 1: "FAIL", 2: "ERROR (could not verify)"}[code]
    return f"Result: {verdict} (exit code {code})"


def junit_xml(suite: str, checks: list[Check]) -> str:
    """JUnit XML for CI systems: one test case per check."""
    import xml.etree.ElementTree as ET

    counts = {s: sum(c.status == s for c in checks) for s in _STATUS_ORDER}
    root = ET.Element("testsuite", name=suite, tests=str(len(checks)),
                      failures=str(counts["fail"]), errors=str(counts["error"]),
                      skipped=str(counts["skip"]))
    for index, check in enumerate(checks):
        name = f"{check.group}[{index}]" + (f" layer {check.layer}" if check.layer is not None
                                            else "")
        case = ET.SubElement(root, "testcase", classname=f"{suite}.{check.group}", name=name)
        tag = {"fail": "failure", "error": "error", "skip": "skipped"}.get(check.status)
        if tag:
            ET.SubElement(case, tag, message=check.message)
        else:
            ET.SubElement(case, "system-out").text = check.message
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
