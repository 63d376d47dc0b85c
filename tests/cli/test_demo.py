"""`kvcalib demo` (what `make demo` runs) fails loudly: a non-zero exit naming the step."""

from __future__ import annotations

import os

from conftest import run_kvcalib


def test_a_step_that_stops_the_demo_is_named(tmp_path):
    result = run_kvcalib("demo", "--output", tmp_path / "demo", "--num-samples", "0")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "Error: demo step 'run' failed: --num-samples must be at least 1, got 0")


def test_a_failed_check_fails_the_demo_and_names_it(tmp_path):
    """Every step runs; verify could not (the serving python is not Python), so the demo
    exits 2 and says which step, after printing where everything else went."""
    env = {**os.environ, "KVCALIB_VLLM_PYTHON": "/bin/false"}
    result = run_kvcalib("demo", "--output", tmp_path / "demo", "--num-samples", "2",
                         "--max-seq-len", "16", env=env, timeout=1800)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1] == "Demo FAILED: verify (exit code 2)"
    assert "Result: ERROR (could not verify) (exit code 2)" in result.stdout
    assert "$KVCALIB_VLLM_PYTHON names /bin/false, which is not a Python interpreter" in (
        result.stdout)
    assert (tmp_path / "demo" / "scales.png").exists()  # the steps after verify ran
