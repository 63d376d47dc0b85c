"""`kvcalib run` on the real SmolLM2-135M-Instruct through the CLI."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from conftest import run_kvcalib
from reference import expected_scale, kv_absmax, q_absmax, sample_token_ids, saved_scales

LAYERS, KV_HEADS, HEADS = 30, 3, 9


def _report(ckpt):
    return json.loads((ckpt / "kvcalib_report.json").read_text())


@pytest.mark.parametrize("fixture", ["smol_tensor_q", "smol_attn_head"])
def test_scales_match_recomputed_absmax(fixture, request, demo_model):
    ckpt = request.getfixturevalue(fixture)
    report = _report(ckpt)
    strategy = report["scheme"]["strategy"]
    token_ids = sample_token_ids(ckpt)
    # The reference runs the uncalibrated input model, without compressed-tensors.
    reference = kv_absmax(demo_model, token_ids, report["compute"]["dtype"])
    if report["scheme"]["q_scale"]:
        reference.update(q_absmax(demo_model, token_ids, report["compute"]["dtype"]))
    scales = saved_scales(ckpt)
    kinds = ("k", "v", "q") if report["scheme"]["q_scale"] else ("k", "v")
    assert len(scales) == LAYERS * len(kinds)
    for layer in range(LAYERS):
        for kind in kinds:
            saved = scales[f"model.layers.{layer}.self_attn.{kind}_scale"]
            heads = HEADS if kind == "q" else KV_HEADS
            assert saved.shape == ((heads, 1, 1) if strategy == "attn_head" else (1,))
            want = expected_scale(reference[(layer, kind)], strategy, torch.bfloat16)
            torch.testing.assert_close(saved.flatten().float(), want.float(), rtol=2**-8, atol=0)
    # The report's hash is of exactly these token ids (recomputed here independently).
    digest = hashlib.sha256()
    for ids in token_ids:
        digest.update(len(ids).to_bytes(8, "little") + np.asarray(ids, "<i8").tobytes())
    assert report["dataset"]["token_ids_sha256"] == digest.hexdigest()


def test_weights_bit_identical_and_files_copied(smol_tensor_q, demo_model):
    index = json.loads((smol_tensor_q / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(demo_model / "model.safetensors", "pt") as src:
        names = list(src.keys())
        assert set(names) <= set(index)
        for name in names:
            with safe_open(smol_tensor_q / index[name], "pt") as dst:
                a, b = src.get_tensor(name), dst.get_tensor(name)
                assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        assert (smol_tensor_q / name).read_bytes() == (demo_model / name).read_bytes()
    config = json.loads((smol_tensor_q / "config.json").read_text())
    quant = config["quantization_config"]
    assert quant["quant_method"] == "compressed-tensors"
    assert quant["kv_cache_scheme"]["type"] == "float" and quant["kv_cache_scheme"]["num_bits"] == 8
    assert quant["config_groups"]["group_0"]["targets"] == ["LlamaAttention"]  # the q_scale group
    assert (smol_tensor_q / "recipe.yaml").is_file()


def test_report_contents(smol_attn_head):
    report = _report(smol_attn_head)
    token_ids = sample_token_ids(smol_attn_head)  # re-tokenized from the report's rows
    assert report["samples"] == {"requested": 6, "used": 6, "max_seq_len": 128,
                                 "num_tokens": sum(map(len, token_ids)), "seed": 0}
    assert report["dataset"]["source"] == "builtin" and len(report["dataset"]["rows_used"]) == 6
    assert report["scheme"]["observer"] == "static_minmax"
    assert report["pipeline"]["used"] == "basic"
    assert {"llmcompressor", "compressed-tensors", "transformers", "torch"} <= set(
        report["versions"])
    assert {"load", "calibrate", "save", "total"} <= set(report["timings_s"])
    layer0 = report["layers"][0]
    assert len(layer0["k_scale"]) == KV_HEADS and len(layer0["k_absmax"]) == KV_HEADS
    np.testing.assert_allclose(layer0["k_scale"], np.array(layer0["k_absmax"]) / 448, rtol=2**-8)


def test_same_inputs_give_identical_bytes(smol_attn_head, demo_model, tmp_path):
    out = tmp_path / "again"
    result = run_kvcalib("run", "--model", demo_model, "--output", out, "--dataset", "builtin",
                         "--num-samples", 6, "--max-seq-len", 128, "--strategy", "attn_head")
    assert result.returncode == 0, result.stderr
    for name in ("kv_scales.safetensors", "model.safetensors.index.json", "config.json"):
        assert (out / name).read_bytes() == (smol_attn_head / name).read_bytes(), name
    # It ends with where per-head scales serve, and the fix where they do not.
    served = served_table(result.stdout)
    assert served["vllm-hopper"] == "serves" and served["vllm-ampere"] == "refuses"
    assert served["sglang-hopper"] == "scale 1.0" and served["vllm-cpu-avx512"] == "reduced"
    assert "per-head quant scales not supported" in result.stdout
    assert "kvcalib convert CKPT --strategy tensor" in result.stdout


def served_table(stdout: str) -> dict[str, str]:
    """run's "Where it serves" table: target -> outcome."""
    rows = stdout.split("Where it serves:\n", 1)[1].splitlines()[2:]
    return {row.split("  ")[0]: row.split("  ", 1)[1].strip().split("  ")[0]
            for row in rows if row.startswith(("vllm", "sglang"))}


def test_sequential_pipeline_gives_the_same_scales(smol_attn_head, demo_model, tmp_path):
    out = tmp_path / "sequential"
    result = run_kvcalib("run", "--model", demo_model, "--output", out, "--dataset", "builtin",
                         "--num-samples", 6, "--max-seq-len", 128, "--strategy", "attn_head",
                         "--pipeline", "sequential", "--json", "-")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["pipeline"]["used"] == "sequential"
    assert (out / "kv_scales.safetensors").read_bytes() == (
        smol_attn_head / "kv_scales.safetensors").read_bytes()


def test_summary_table_and_progress(smol_tensor_q, demo_model, tmp_path):
    result = run_kvcalib("run", "--model", demo_model, "--output", tmp_path / "o", "--dataset",
                         "builtin", "--num-samples", 2, "--max-seq-len", 32)
    assert result.returncode == 0, result.stderr
    assert "Calibrating 30 attention layers on 2 samples" in result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["layer", "k_scale", "v_scale", "k", "absmax", "v", "absmax"]
    assert [int(line.split()[0]) for line in lines[2:2 + LAYERS]] == list(range(LAYERS))
    assert lines[2 + LAYERS].startswith("2 samples x <= 32 tokens")
    assert f"Checkpoint: {tmp_path / 'o'}" in result.stdout
    served = served_table(result.stdout)
    assert len(served) >= 9 and set(served.values()) == {"serves"}  # per-tensor, head 64
