"""The static verify of a 70B-shaped checkpoint reads headers and scales, not weights.

Uses scripts/bench_verify.py's builder (sparse files: ~141 GB declared, <1 MB on disk).
Asserts the bytes-read bound only; times are the benchmark's business.
"""

from __future__ import annotations

import importlib.util

from conftest import ROOT

SCRIPT = ROOT / "scripts" / "bench_verify.py"


def test_static_verify_reads_under_one_megabyte(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_verify", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    declared = bench.build(tmp_path / "ckpt")
    assert declared > 140e9
    result = bench.measure(tmp_path / "ckpt")
    # scheme, weight files, layers, then k and v of every layer
    assert result["failed"] == 0 and result["checks"] == 3 + 2 * bench.LAYERS
    assert result["bytes_read"] < 1_000_000, result
