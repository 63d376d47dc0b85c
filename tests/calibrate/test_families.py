"""Every model family of scripts/families.py through kvcalib, without an engine.

Each family's tiny model keeps its real attention geometry. For each: `run` writes k/v
scales for exactly its attention layers (from the layer types the family declares, not
from kvcalib's geometry), each equal to absmax/448 recomputed from a plain transformers
forward (tests/reference.py); static verify passes; a short simulated eval runs on the
same layers. MLA families are refused before anything is loaded or written, and static
verify fails an MLA checkpoint made elsewhere, naming vLLM's file and function.
The engine part for MoE, hybrid and MLA families is in tests/verify/test_families_engine.py;
scripts/architectures.py runs the whole matrix in the engine.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import peers
from conftest import builtin
from families import FAMILIES, with_kv_scales
from kvcalib.calibrate import ScaleOptions, calibrate
from kvcalib.checkpoint.read import open_checkpoint
from kvcalib.checks import FAIL, PASS
from kvcalib.errors import UsageError
from kvcalib.evaluate import EvalOptions, HeldOut, evaluate
from reference import expected_scale, kv_absmax, sample_token_ids, saved_scales

MLA = [name for name, family in FAMILIES.items() if family.mla]
CALIBRATED = [name for name in FAMILIES if name not in MLA]


@pytest.mark.parametrize("name", CALIBRATED)
def test_family_calibrates_its_attention_layers_to_the_recomputed_absmax(name, family_model,
                                                                          tmp_path):
    family = FAMILIES[name]
    model = family_model(name)
    out = calibrate(model, tmp_path / "out", scales=ScaleOptions(strategy="attn_head"),
                    samples=builtin(2, 48), log=lambda _: None).output
    layers = family.attention_layers()
    kv_heads = family.tiny_kwargs()["num_key_value_heads"]
    scales = saved_scales(out)
    assert sorted(scales) == sorted(f"model.layers.{layer}.self_attn.{kind}_scale"
                                    for layer in layers for kind in ("k", "v"))
    report = json.loads((out / "kvcalib_report.json").read_text())
    reference = kv_absmax(model, sample_token_ids(out), report["compute"]["dtype"])
    assert sorted({layer for layer, _ in reference}) == layers
    for (layer, kind), absmax in reference.items():
        saved = scales[f"model.layers.{layer}.self_attn.{kind}_scale"]
        assert saved.shape == (kv_heads, 1, 1)
        want = expected_scale(absmax, "attn_head", torch.bfloat16)
        # Within one bf16 step: both compute in bf16, through different kernels (gpt-oss's
        # key bias rounds differently under llm-compressor's hooks).
        torch.testing.assert_close(saved.flatten().float(), want.float(), rtol=2**-7, atol=0)
    _, checks = open_checkpoint(out)
    assert [c.message for c in checks if c.status == FAIL] == []
    passed = [c for c in checks if c.group == "scales" and c.status == PASS]
    assert sorted(c.layer for c in passed) == sorted(layers * 2)  # k and v
    # The simulated cache touches the attention layers alone, whatever their projections
    # (Phi-4's fused qkv_proj), windows and sinks (gpt-oss), or neighbours (gated delta
    # net, Mamba-2); scale 1.0 on keys of this size costs something but stays finite.
    result = evaluate(out, EvalOptions(held_out=HeldOut(num_samples=2, max_seq_len=48)),
                      log=lambda _: None).to_dict()
    assert result["layer_scales"]["layers"] == layers
    for metrics in result["metrics"].values():
        assert 0 <= metrics["mean_kl"] < 1


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_as_transformers_saves_it_has_every_weight_its_class_needs(name,
                                                                               family_model):
    """MoE checkpoints keep per-expert names that transformers merges when it loads them
    (Mixtral's block_sparse_moe.experts.0.w1.weight): the weight check follows
    transformers' own renaming, so no family is refused for its names."""
    _, checks = open_checkpoint(family_model(name))
    weights = [c for c in checks if c.group == "weights"]
    assert [c.message for c in weights if c.status != PASS] == []
    assert len(weights) == 1 and "the model class" in weights[0].message


def test_a_moe_layer_without_its_experts_is_named_by_the_merged_parameter(family_model,
                                                                           tmp_path):
    model = family_model("Mixtral")
    shutil.copytree(model, tmp_path / "m")
    tensors = peers.raw_tensors(model / "model.safetensors")
    peers._write(tmp_path / "m" / "model.safetensors",
                 [(n, d, s, r) for n, (d, s, r) in sorted(tensors.items())
                  if ".layers.1.block_sparse_moe.experts." not in n])
    _, checks = open_checkpoint(tmp_path / "m")
    said = [c.message for c in checks if c.group == "weights"]
    assert said == ["weights do not match the model class MixtralForCausalLM: 2 missing: "
                    "model.layers.1.mlp.experts.down_proj, "
                    "model.layers.1.mlp.experts.gate_up_proj"]


@pytest.mark.parametrize("name", ["Qwen3-MoE", "Mixtral", "GLM-4.5", "MiniMax-M2",
                                  "Qwen3-Next", "DeepSeek-V3"])
def test_a_merged_parameter_missing_some_experts_names_them(name, family_model, tmp_path):
    """These families store one tensor per expert, which transformers stacks into one
    parameter: two experts of one kind missing would load a parameter of the wrong size."""
    model = family_model(name)
    config = json.loads((model / "config.json").read_text())
    count = next(config[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")
                 if k in config)
    tensors = peers.raw_tensors(model / "model.safetensors")
    kind = sorted(n for n in tensors if ".experts.1." in n)[-1]  # the last layer's last kind
    dropped = {kind.replace(".experts.1.", f".experts.{i}.") for i in (1, 2)}
    assert dropped <= set(tensors) and count >= 3
    shutil.copytree(model, tmp_path / "m")
    peers._write(tmp_path / "m" / "model.safetensors",
                 [(n, d, s, r) for n, (d, s, r) in sorted(tensors.items()) if n not in dropped])
    _, checks = open_checkpoint(tmp_path / "m")
    said = [c.message for c in checks if c.group == "weights"]
    assert len(said) == 1 and said[0].endswith(
        f"1 missing: {kind.replace('.experts.1.', '.experts.*.')} for experts 1-2 of {count}")


@pytest.mark.parametrize("name", MLA)
def test_mla_family_is_refused_before_loading_and_writes_nothing(name, family_model, tmp_path):
    with pytest.raises(UsageError) as refused:
        calibrate(family_model(name), tmp_path / "out", samples=builtin(1, 16),
                  log=lambda _: None)
    said = str(refused.value)
    assert "multi-head latent attention" in said
    assert "base_config.py, QuantizationConfig.get_cache_scale_mapper" in said
    assert "576 values per token" in said  # kv_lora_rank 512 + qk_rope_head_dim 64
    assert not (tmp_path / "out").exists()


def test_static_verify_fails_an_mla_checkpoint_made_elsewhere(family_model, tmp_path):
    ckpt = with_kv_scales(family_model("DeepSeek-V3"), tmp_path / "llmc-style")
    _, checks = open_checkpoint(ckpt)
    failed = [c.message for c in checks if c.status == FAIL]
    assert len(failed) == 1
    assert failed[0].startswith("vLLM will not load these scales: DeepseekV3ForCausalLM uses "
                                "multi-head latent attention")
    assert "maybe_remap_kv_scale_name" in failed[0]
