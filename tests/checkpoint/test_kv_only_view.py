"""eval --engine's KV-only view (checkpoint.write.write_with_kv_scales): an unquantized
model's weights with another checkpoint's KV scales, read back here with the tiny files'
own safetensors reader. Not in the fast tier: the KV-only quantization_config is built
with compressed-tensors' types, which import torch."""

from __future__ import annotations

import json

import pytest

import tiny_files
from kvcalib.checkpoint import open_model
from kvcalib.checkpoint import write as weights
from kvcalib.errors import CheckpointError

WEIGHTS = sorted(tiny_files.weight_shapes())


def test_kv_only_view_carries_another_checkpoints_scales(tmp_path):
    """eval --engine's KV-only row: the unquantized weights (a lone model.safetensors, no
    index), linked, with the scales of a checkpoint that has them, byte for byte, and its
    kv_cache_scheme in a quantization_config that quantizes no weights."""
    weights_only = tiny_files.build(tmp_path / "plain", {"model.safetensors": WEIGHTS},
                                    scheme=False)
    with_scales = tiny_files.build(tmp_path / "quantized", {
        "model.safetensors": WEIGHTS, "scales.safetensors": tiny_files.scale_names()}, seed=1)
    before = tiny_files.digests(weights_only), tiny_files.digests(with_scales)
    out = tmp_path / "view"
    out.mkdir()
    written = weights.write_with_kv_scales(weights_only, open_model(with_scales), out)
    assert written == sorted(tiny_files.scale_names())
    stored = tiny_files.indexed_tensors(out)
    plain = tiny_files.peers.raw_tensors(weights_only / "model.safetensors")
    scales = tiny_files.peers.raw_tensors(with_scales / "scales.safetensors")
    assert stored == {**plain, **scales}
    assert (out / "model.safetensors").is_symlink() and (out / "tokenizer.json").is_symlink()
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["kv_cache_scheme"] | tiny_files.KV_SCHEME["kv_cache_scheme"] == \
        quant["kv_cache_scheme"]
    assert quant["config_groups"] == {} and quant["format"] == "dense"
    assert (tiny_files.digests(weights_only), tiny_files.digests(with_scales)) == before


def test_kv_only_view_needs_a_compressed_tensors_scheme(tmp_path):
    plain = tiny_files.build(tmp_path / "plain", {"model.safetensors": WEIGHTS}, scheme=False)
    out = tmp_path / "view"
    out.mkdir()
    with pytest.raises(CheckpointError, match="declares no compressed-tensors kv_cache_scheme"):
        weights.write_with_kv_scales(plain, open_model(plain), out)


@pytest.mark.parametrize("scheme, message", [
    ({"num_bits": "eight", "type": "float"}, "is not compressed-tensors' QuantizationArgs"),
    (["not", "a", "scheme"], "declares no compressed-tensors kv_cache_scheme"),
])
def test_a_malformed_kv_scheme_is_one_error_and_nothing_written(scheme, message, tmp_path):
    plain = tiny_files.build(tmp_path / "plain", {"model.safetensors": WEIGHTS}, scheme=False)
    other = tiny_files.build(tmp_path / "other", {"model.safetensors": WEIGHTS})
    config = json.loads((other / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = scheme
    (other / "config.json").write_text(json.dumps(config))
    out = tmp_path / "view"
    out.mkdir()
    with pytest.raises(CheckpointError, match=message):
        weights.write_with_kv_scales(plain, open_model(other), out)
    assert list(out.iterdir()) == []
