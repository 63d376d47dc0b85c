"""`kvcalib convert` between ModelOpt and Quark on their real exports, per-head scales to a
per-tensor format, and bad input (conversions to compressed-tensors need torch:
tests/verify/test_peer_engine.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import peers
from conftest import assert_error, failures, run_kvcalib, tree_digest, verify_static
from tiny_files import complete_weights

NAMES = {"modelopt": "model.layers.{layer}.self_attn.{kind}_proj.{kind}_scale",
         "quark": "model.layers.{layer}.self_attn.{kind}_proj.output_scale"}


def convert(src: Path, to: str, out: Path) -> dict:
    result = run_kvcalib("convert", src, "--to", to, "--output", out, "--json", "-")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def output_tensors(out: Path) -> dict[str, tuple[str, list[int], bytes]]:
    found = {}
    for path in out.glob("*.safetensors"):
        found.update(peers.raw_tensors(path))
    return found


def bf16_at_or_above(value: float) -> float:
    """The smallest bfloat16 >= value, by enumerating the two neighbours."""
    bits = np.array([value], dtype="<f4").view("<u4")[0] >> 16
    for candidate in (bits, bits + 1):
        decoded = float(peers.as_float("BF16", np.array([candidate], "<u2").tobytes())[0])
        if decoded >= value:
            return decoded
    raise AssertionError(value)


@pytest.mark.parametrize("source, to", [("quark-kv-post-rope", "modelopt"),
                                        ("modelopt-kv", "quark")])
def test_convert_between_peer_formats(source, to, tmp_path):
    """Every other tensor keeps its bytes; the scales keep their values (rounded up where
    the target's dtype is narrower); verify then passes, as it did not on the export."""
    src = peers.materialize(source, tmp_path / "src", fill="random")
    before = tree_digest(src)
    result = convert(src, to, tmp_path / "out")
    assert tree_digest(src) == before
    assert (result["source_layout"], result["target_layout"], result["strategy"]) == (
        source.split("-")[0], to, "tensor")
    stored, written = peers.raw_tensors(src / "model.safetensors"), output_tensors(
        tmp_path / "out")
    old = peers.scales(source)
    for name in set(stored) - set(old):
        assert written[name] == stored[name], name
    assert set(written) - set(stored) == {NAMES[to].format(layer=i, kind=k)
                                          for i in range(30) for k in "kv"}
    target_dtype = {"modelopt": "F32", "quark": "BF16"}[to]
    for name, value in old.items():
        layer, kind = int(name.split(".")[2]), name.split(".")[4][0]
        dtype, shape, raw = written[NAMES[to].format(layer=layer, kind=kind)]
        assert (dtype, shape) == (target_dtype, [])
        got = float(peers.as_float(dtype, raw)[0])
        assert got == (value if dtype == "F32" else bf16_at_or_above(value))
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == to
    assert not (tmp_path / "out" / "hf_quant_config.json").exists()
    code, report, stdout = verify_static(tmp_path / "out", tmp_path)
    assert code == 0 and report["scheme"]["layout"] == to, stdout
    assert verify_static(src, tmp_path)[0] == 1  # the export itself: vLLM refuses it


def _compressed_tensors(folder: Path, scales: dict[str, np.ndarray], extra=None) -> Path:
    """Two attention layers of a GQA model with per-head scales, calibrated elsewhere."""
    folder.mkdir()
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 2, "hidden_size": 512, "torch_dtype": "bfloat16",
              "quantization_config": {
                  "quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
                  "kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": True,
                                      "dynamic": False, "strategy": "attn_head"}}}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({**complete_weights(config), **scales, **(extra or {}),
               "model.layers.0.mlp.up_proj.weight": np.ones((4, 4), dtype=np.float16)},
              folder / "model.safetensors")
    return folder


def per_head_scales() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {f"model.layers.{i}.self_attn.{k}_scale":
            rng.uniform(0.01, 0.05, (2, 1, 1)).astype(np.float32) for i in (0, 1) for k in "kv"}


@pytest.mark.parametrize("to", ["modelopt", "quark"])
def test_per_head_scales_become_the_largest_head(to, tmp_path):
    scales = per_head_scales()
    result = convert(_compressed_tensors(tmp_path / "ct", scales), to, tmp_path / "out")
    assert any("attn_head scales became per-tensor ones, the largest head's" in note
               for note in result["notes"])
    written = output_tensors(tmp_path / "out")
    for name, values in scales.items():
        layer, kind = int(name.split(".")[2]), name[-7]
        dtype, _, raw = written[NAMES[to].format(layer=layer, kind=kind)]
        want = float(values.max())
        got = float(peers.as_float(dtype, raw)[0])
        assert got == (want if dtype == "F32" else bf16_at_or_above(want))
    assert verify_static(tmp_path / "out", tmp_path)[0] == 0


def test_bad_input(tmp_path):
    ct = _compressed_tensors(tmp_path / "ct", per_head_scales())
    quark = peers.materialize("quark-kv-post-rope", tmp_path / "quark")
    plain = tmp_path / "plain"
    plain.mkdir()
    plain_config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8,
                    "num_key_value_heads": 2, "hidden_size": 512}
    (plain / "config.json").write_text(json.dumps(plain_config))
    save_file(complete_weights(plain_config), plain / "model.safetensors")
    fp8_weights = _compressed_tensors(tmp_path / "w8", per_head_scales(), extra={
        "model.layers.0.mlp.up_proj.weight_scale": np.ones(1, np.float32)})
    cases = [
        ((quark, "--to", "gguf"), "'gguf' is not one of 'compressed-tensors', 'modelopt', "
                                  "'quark'"),
        ((quark, "--to", "quark"), f"{quark} is already a quark checkpoint"),
        ((quark,), f"{quark} is already a quark checkpoint with tensor scales"),
        ((ct, "--strategy", "attn_head"), "already a compressed-tensors checkpoint with "
                                         "attn_head scales"),
        ((quark, "--to", "modelopt", "--strategy", "attn_head"),
         "has per-tensor scales: one scale per layer cannot become one per head"),
        ((ct, "--to", "quark", "--strategy", "attn_head"), "quark has one KV scale per layer, "
                                                           "no per-head scales"),
        ((ct, "--strategy", "channel"), "'channel' is not one of 'tensor', 'attn_head'"),
        ((plain, "--to", "quark"), f"{plain} has no KV scales to convert: the checkpoint "
                                   "declares no KV-cache quantization"),
        ((fp8_weights, "--to", "quark"), "has quantized weights (e.g. model.layers.0.mlp."
                                         "up_proj.weight_scale)"),
        ((tmp_path / "nope", "--to", "quark"), "checkpoint folder not found"),
        ((ct, "--to", "quark", "--output", ct / "inside"), "is inside the input model folder"),
    ]
    for args, message in cases:
        if "--output" not in args:
            args = (*args, "--output", tmp_path / "out")
        before = tree_digest(tmp_path)
        assert_error(run_kvcalib("convert", *args), 2, message)
        assert tree_digest(tmp_path) == before  # nothing written, input untouched


def test_a_scale_verify_refuses_is_not_converted(tmp_path):
    scales = per_head_scales()
    scales["model.layers.1.self_attn.v_scale"][0] = np.nan
    ckpt = _compressed_tensors(tmp_path / "ct", scales)
    assert_error(run_kvcalib("convert", ckpt, "--to", "modelopt", "--output", tmp_path / "o"),
                 2, "its KV scales do not pass verify: model.layers.1.self_attn.v_scale: "
                    "non-finite value")
    code, report, _ = verify_static(ckpt, tmp_path)
    assert code == 1 and "non-finite" in failures(report)[0]
