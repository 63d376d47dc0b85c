"""verify's "where it serves" table and its gate (kvcalib.engine.targets): without
--target the common targets are shown and nothing is gated; each named target that would
not serve the scales as calibrated fails with the engine's own words, one test per outcome.
The rules themselves are checked against the engines' code by scripts/serving_targets.py
(tests/engine/test_serving_targets.py)."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from conftest import assert_error, run_kvcalib, verify_static
from tiny_files import kv_checkpoint as checkpoint


def serving(report: dict) -> dict[str, dict]:
    return {c["tensor"]: c for c in report["checks"] if c["group"] == "serving"}


def test_default_table_shows_common_targets_and_gates_nothing(tmp_path):
    code, report, stdout = verify_static(checkpoint(tmp_path / "heads", "attn_head"), tmp_path)
    assert code == 0
    checks = serving(report)
    assert "vllm-cpu-avx2" not in checks  # not a common target
    assert checks["vllm-hopper"]["status"] == "pass"
    assert checks["vllm-ampere"]["status"] == "warn"
    assert checks["vllm-ampere"]["value"] == "refuses"
    assert checks["sglang-hopper"]["value"] == "scale 1.0"
    assert checks["vllm-cpu-avx512"]["value"] == "reduced"
    assert "Where it serves:" in stdout
    assert "per-head quant scales not supported" in stdout
    assert "kvcalib convert CKPT --strategy tensor" in stdout
    assert report["traits"]["strategy"] == "attn_head" and report["traits"]["head_size"] == 64
    assert {v["target"] for v in report["serving"]} == set(checks)


@pytest.mark.parametrize(("strategy", "head_dim", "extra", "target", "outcome", "said"), [
    ("attn_head", 64, {}, "vllm-ampere", "refuses", "per-head quant scales not supported"),
    ("attn_head", 64, {}, "vllm-rocm-mi300", "refuses", "per-head quant scales not supported"),
    ("attn_head", 64, {}, "sglang-hopper", "scale 1.0",
     "only static symmetric per-tensor FP8 scales are supported"),
    ("attn_head", 64, {}, "vllm-cpu-avx512", "reduced", "computes with their largest"),
    ("tensor", 64, {"alibi": True}, "vllm-hopper", "refuses",
     "FlashAttention does not support fp8 kv-cache on this device."),
    ("tensor", 80, {}, "vllm-cpu-avx512", "refuses",
     "FP8 KV cache requires head_size divisible by 32 on CPU."),
    ("tensor", 64, {}, "vllm-cpu-avx2", "refuses",
     "FP8 KV cache on CPU requires x86 with AVX-512 or AMX."),
    ("attn_head", 160, {}, "vllm-blackwell", "refuses",
     "FP8 KV cache requires FA3 on SM90, FA4 with head_size=512 on SM90, or FA4 on SM100"),
])
def test_a_named_target_that_does_not_serve_fails(tmp_path, strategy, head_dim, extra, target,
                                                  outcome, said):
    ckpt = checkpoint(tmp_path / "ckpt", strategy, head_dim, **extra)
    code, report, stdout = verify_static(ckpt, tmp_path, "--target", f"vllm-hopper,{target}")
    assert code == 1
    check = serving(report)[target]
    assert (check["status"], check["value"]) == ("fail", outcome)
    assert said in check["message"] and said in stdout
    suite = ET.parse(tmp_path / "v.xml").getroot()
    failed = [case for case in suite.iter("testcase") if case.find("failure") is not None]
    assert any(said in case.find("failure").get("message", "") + (case.find("failure").text
               or "") for case in failed)


def test_named_targets_that_serve_pass(tmp_path):
    code, report, _ = verify_static(checkpoint(tmp_path / "t"), tmp_path,
                                    "--target", "vllm-hopper", "--target", "sglang-blackwell")
    assert code == 0
    assert {k: c["status"] for k, c in serving(report).items()} == {
        "vllm-hopper": "pass", "sglang-blackwell": "pass"}


def test_all_names_every_target(tmp_path):
    from kvcalib.engine.targets import TARGETS

    _, report, _ = verify_static(checkpoint(tmp_path / "t"), tmp_path, "--target", "all")
    assert set(serving(report)) == set(TARGETS) and len(TARGETS) >= 10


def test_an_unknown_target_is_a_usage_error(tmp_path):
    result = run_kvcalib("verify", checkpoint(tmp_path / "t"), "--static-only",
                         "--target", "vllm-tpu")
    assert_error(result, 2, "unknown --target vllm-tpu; choose from vllm-ampere")
