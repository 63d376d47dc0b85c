"""`kvcalib eval` as users run it: table, JSON, plot, gates, KIVI, the engine cross-check."""

from __future__ import annotations

import json

import pytest

from conftest import run_kvcalib

SMALL = ["--num-samples", 2, "--max-seq-len", 64, "--passkey-lengths", 256,
         "--passkey-depths", 0.5]


@pytest.fixture(scope="module")
def eval_run(smol_attn_head, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    result = run_kvcalib("eval", smol_attn_head, *SMALL, "--sweep", "--sweep-samples", 1,
                         "--kivi", "--kivi-group", 16, "--kivi-residual", 16,
                         "--max-kl", 1e-9, "--max-ppl-increase", 0.5, "--min-passkey", 0,
                         "--json", out / "eval.json", "--plot", out / "eval.png")
    return result, json.loads((out / "eval.json").read_text()), out


def test_gates_and_exit_code(eval_run):
    result, report, _ = eval_run
    assert result.returncode == 1, result.stderr
    gates = [c for c in report["checks"] if c["group"] == "gate"]
    assert [g["status"] for g in gates] == ["fail", "pass", "pass"]
    assert gates[0]["message"].startswith("calibrated (e4m3): mean KL ")
    assert "Result: FAIL (exit code 1)" in result.stdout
    assert "Traceback" not in result.stderr


def test_table_json_and_kivi(eval_run):
    result, report, _ = eval_run
    metrics = report["metrics"]
    kivi = "kivi 2-bit (G=16, R=16)"
    assert set(metrics) == {"calibrated (e4m3)", "scale 1.0 (e4m3)", "scale 1.0 (e5m2)", kivi}
    assert metrics[kivi]["mean_kl"] > metrics["calibrated (e4m3)"]["mean_kl"]  # 2 bits < 8
    for line in ("calibrated (e4m3)", "scale 1.0 (e5m2)", kivi, "Passkey retrieval"):
        assert line in result.stdout
    # SmolLM2: C = 3 KV heads x 64 = 192 channels, 30 layers, 64-token samples, G = R = 16.
    # Keys: 3 groups x (16 x 48 B codes + 4 x 192 B scale/zero) + 16 exact x 192 x 2 B.
    # Values: 48 tokens x (48 B codes + 4 x 12 groups) + 16 exact x 192 x 2 B.
    keys = 3 * (16 * 48 + 4 * 192) + 16 * 192 * 2
    values = 48 * (48 + 4 * 12) + 16 * 192 * 2
    assert report["kivi"]["bytes_per_token"]["kivi"] == 30 * (keys + values) / 64
    assert report["kivi"]["bytes_per_token"]["fp8"] == 2 * 192 * 30
    assert report["kivi"]["bytes_per_token"]["16bit"] == 2 * 192 * 30 * 2


def test_sweep_and_plot(eval_run):
    _, report, out = eval_run
    sweep = report["sweep"]
    assert len(sweep["layers"]) == 30 and sweep["samples"] == 1
    assert not sweep["recommendation"]["met"] or sweep["recommendation"]["kl"] <= 1e-9
    png = (out / "eval.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000


def test_bad_options(smol_attn_head):
    result = run_kvcalib("eval", smol_attn_head, "--rounding", "up")
    assert result.returncode == 2 and "unknown rounding 'up'" in result.stderr
    result = run_kvcalib("eval", smol_attn_head, "--passkey-lengths", "long")
    assert result.returncode == 2 and "is not a comma-separated list" in result.stderr
    result = run_kvcalib("eval", smol_attn_head / "nope")
    assert result.returncode == 2 and "checkpoint folder not found" in result.stderr


@pytest.mark.engine
def test_engine_cross_check(smol_attn_head, fp8_kv_supported, tmp_path):
    result = run_kvcalib("eval", smol_attn_head, "--num-samples", 2, "--max-seq-len", 64,
                         "--passkey-lengths", "", "--engine", "--json", tmp_path / "e.json",
                         timeout=1800)
    report = json.loads((tmp_path / "e.json").read_text())
    engine = report["engine"]
    assert engine["capacity"]["ratio"] == pytest.approx(2.0, abs=0.1)
    if fp8_kv_supported:
        assert result.returncode == 0, result.stdout
        assert engine["outputs"]["positions"] == 2 * 63
    else:
        assert result.returncode == 2, result.stdout
        assert "cannot run an FP8 KV cache" in engine["error"]
    assert (tmp_path / "vllm-fp8.log").exists() and (tmp_path / "vllm-bfloat16.log").exists()
