"""`verify` options that cannot work are usage or environment errors (exit 2), said clearly,
before any engine starts."""

from __future__ import annotations

import json

import pytest

from conftest import run_kvcalib


@pytest.mark.parametrize("timeout", ["-5", "0", "nan"])
def test_a_timeout_that_is_not_positive_is_refused(demo_model, tmp_path, timeout):
    result = run_kvcalib("verify", demo_model, "--timeout", timeout, "--log-dir", tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        f"Error: --timeout must be a positive number of seconds, not {float(timeout):g}"]
    assert list(tmp_path.iterdir()) == []  # nothing started, no log


def test_an_interpreter_that_is_not_python_is_an_environment_error(smol_attn_head, tmp_path):
    report = tmp_path / "verify.json"
    result = run_kvcalib("verify", smol_attn_head, "--vllm-python", "/bin/false", "--json", report,
                         "--log-dir", tmp_path / "logs")
    assert result.returncode == 2, result.stdout + result.stderr
    (engine,) = [c for c in json.loads(report.read_text())["checks"] if c["group"] == "engine"]
    assert engine == {
        "group": "engine", "status": "error", "layer": None, "tensor": None, "value": None,
        "message": "--vllm-python names /bin/false, which is not a Python interpreter: "
                   "`/bin/false -c ...` exited with code 1 and printed nothing"}
    assert not (tmp_path / "logs").exists()
