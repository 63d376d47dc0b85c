"""Short forms every message and table shares: index ranges, value ranges, byte sizes."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

Log = Callable[[str], None]


def stderr(message: str) -> None:
    """The default `log` of the library's long-running functions."""
    print(message, file=sys.stderr, flush=True)


def index_ranges(indices: Sequence[int]) -> str:
    """'0-3, 7, 9-12': layer lists stay short in messages and tables."""
    runs: list[list[int]] = []
    for index in sorted(indices):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def value_range(values: Sequence[float], spec: str = ".4g") -> str:
    """One value, or 'lo..hi' over several (a scale's heads)."""
    lo, hi = min(values), max(values)
    return f"{lo:{spec}}" if lo == hi else f"{lo:{spec}}..{hi:{spec}}"


def size(num_bytes: float) -> str:
    """Binary units: '45.00 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:,.0f} B" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def count(value: float | None) -> str:
    """A count for a table: whole numbers with thousands separators."""
    if value is None:
        return "n/a"
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"
