"""`run` on tiny random models of several architectures, both strategies.

Every saved scale is compared with absmax/448 recomputed from a plain transformers
forward pass over the same token ids (tests/reference.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import builtin
from kvcalib.calibrate import ComputeOptions, ScaleOptions, calibrate
from reference import expected_scale, kv_absmax, q_absmax, sample_token_ids, saved_scales

ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3"]


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_scales_match_recomputed_absmax(arch, strategy, tiny_model, tmp_path):
    model = tiny_model(arch)
    out = tmp_path / "out"
    result = calibrate(model, out, scales=ScaleOptions(strategy=strategy),
                       samples=builtin(3, 48), log=lambda _: None)
    assert result.output == out
    report = json.loads((out / "kvcalib_report.json").read_text())
    reference = kv_absmax(model, sample_token_ids(out), report["compute"]["dtype"])
    scales = saved_scales(out)
    assert len(scales) == 2 * 4  # k and v for each of the 4 layers
    for layer in range(4):
        for kind in ("k", "v"):
            saved = scales[f"model.layers.{layer}.self_attn.{kind}_scale"]
            assert saved.shape == ((2, 1, 1) if strategy == "attn_head" else (1,))
            assert saved.dtype == torch.bfloat16
            want = expected_scale(reference[(layer, kind)], strategy, torch.bfloat16)
            torch.testing.assert_close(saved.flatten().float(), want.float(), rtol=2**-8, atol=0)
    scheme = json.loads((out / "config.json").read_text())["quantization_config"]
    assert scheme["kv_cache_scheme"]["strategy"] == strategy


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_sdpa_attention_runs_sdpa_and_matches_an_sdpa_forward(arch, tiny_model, tmp_path,
                                                              monkeypatch):
    """--attention sdpa really calibrates under sdpa (llm-compressor would force eager),
    and every k/v/q scale is absmax/448 of a plain sdpa forward over the same tokens."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *args, **kwargs: calls.append(1) or sdpa(*args, **kwargs))
    model = tiny_model(arch)
    out = calibrate(model, tmp_path / "out",
                    scales=ScaleOptions(strategy="attn_head", q_scale=arch == "llama"),
                    samples=builtin(3, 48), compute=ComputeOptions("basic", attention="sdpa"),
                    log=lambda _: None).output
    # 3 samples through the first 3 layers' attention: the last one's is skipped unless
    # q is observed (the forward stops once its keys and values are cached)
    assert len(calls) == 3 * (4 if arch == "llama" else 3)
    monkeypatch.undo()
    report = json.loads((out / "kvcalib_report.json").read_text())
    assert report["compute"]["attention"] == "sdpa"
    dtype, token_ids = report["compute"]["dtype"], sample_token_ids(out)
    reference = kv_absmax(model, token_ids, dtype, attention="sdpa")
    if arch == "llama":
        reference.update(q_absmax(model, token_ids, dtype, attention="sdpa"))
    scales = saved_scales(out)
    assert len(scales) == len(reference) == 4 * (3 if arch == "llama" else 2)
    for (layer, kind), absmax in reference.items():
        saved = scales[f"model.layers.{layer}.self_attn.{kind}_scale"]
        want = expected_scale(absmax, "attn_head", torch.bfloat16)
        assert torch.equal(saved.flatten(), want), (layer, kind)


def test_sdpa_gives_way_to_eager_when_auto_chooses_sequential(tiny_model, tmp_path,
                                                               monkeypatch):
    """On a GPU too small for the model, `auto` chooses sequential, which traces under
    eager: kvcalib says so and calibrates under eager. Here the CPU's plan is made to
    choose sequential, as memory.plan does for such a GPU."""
    from kvcalib.calibrate import memory

    plan = memory.plan
    monkeypatch.setattr(memory, "plan", lambda _requested, *rest: plan("sequential", *rest))
    said = []
    out = calibrate(tiny_model("llama"), tmp_path / "out", samples=builtin(2, 32),
                    compute=ComputeOptions(attention="sdpa"), log=said.append).output
    report = json.loads((out / "kvcalib_report.json").read_text())
    assert (report["pipeline"]["used"], report["compute"]["attention"]) == ("sequential",
                                                                          "eager")
    assert any("traces under eager attention: calibrating with eager" in s for s in said)


def test_model_without_attention_is_refused(tiny_model, tmp_path):
    from kvcalib.errors import UsageError

    with pytest.raises(UsageError, match="MambaForCausalLM has no attention layers"):
        calibrate(tiny_model("mamba"), tmp_path / "out", samples=builtin(1, 16),
                  log=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_recalibrating_a_calibrated_checkpoint_replaces_its_scales(tiny_model, tmp_path):
    from safetensors import safe_open

    first = calibrate(tiny_model("llama"), tmp_path / "first", samples=builtin(2, 32),
                      log=lambda _: None).output
    second = calibrate(first, tmp_path / "second", scales=ScaleOptions(strategy="attn_head"),
                       samples=builtin(2, 32, seed=1), log=lambda _: None).output
    index = json.loads((second / "model.safetensors.index.json").read_text())["weight_map"]
    names = []
    for file in sorted(set(index.values())):
        with safe_open(second / file, "pt") as f:
            names += list(f.keys())
    scale_names = [n for n in names if n.endswith(("k_scale", "v_scale"))]
    assert len(scale_names) == len(set(scale_names)) == 8  # no stale per-tensor copies
    assert all(index[n] == "kv_scales.safetensors" for n in scale_names)
    assert sorted(names) == sorted(index)
    assert saved_scales(second)["model.layers.0.self_attn.k_scale"].shape == (2, 1, 1)
