"""verify fails a checkpoint whose weights are not all there, naming what is wrong
(issue 20 §2): an empty shard, tensors the index puts in a shard that lacks them, a
truncated shard, a shard missing from a multi-shard index, a git-LFS pointer in place of
a shard, a layer whose weights were removed. Every case keeps valid KV scales, so only
the weights can fail it.

In the fast tier the expected names come from the config (every layer must hold
weights); with transformers, from the model class (tests/checkpoint/test_expected_weights.py
checks single tensors there).
"""

from __future__ import annotations

import json
import os

import pytest

import tiny_files
from conftest import failures, verify_static

WEIGHTS = sorted(tiny_files.weight_shapes())
SCALES = tiny_files.scale_names()
SHARDS = {"model-00001-of-00002.safetensors": [w for w in WEIGHTS if ".layers.1." not in w],
          "model-00002-of-00002.safetensors": [w for w in WEIGHTS if ".layers.1." in w],
          "kv_scales.safetensors": SCALES}


def _verify(folder, tmp_path) -> tuple[int, list[str]]:
    code, report, _ = verify_static(folder, tmp_path)
    return code, failures(report)


def test_complete_checkpoint_passes(tmp_path):
    src = tiny_files.build(tmp_path / "ckpt", SHARDS, index=True)
    code, failed = _verify(src, tmp_path)
    assert (code, failed) == (0, [])


def test_empty_shard_named_by_the_index_fails(tmp_path):
    """The weights shard replaced by an empty but valid safetensors file."""
    src = tiny_files.build(tmp_path / "ckpt", SHARDS, index=True)
    tiny_files.write_file(src / "model-00002-of-00002.safetensors", {})
    code, failed = _verify(src, tmp_path)
    assert code == 1
    assert any("model.layers.1.mlp.down_proj.weight" in f and
               "model-00002-of-00002.safetensors" in f for f in failed), failed


def test_empty_weights_file_without_index_fails(tmp_path):
    src = tiny_files.build(tmp_path / "ckpt", {"model.safetensors": [],
                                                "kv_scales.safetensors": SCALES})
    code, failed = _verify(src, tmp_path)
    assert code == 1
    assert any("layers 0-1" in f or "model.embed_tokens.weight" in f for f in failed), failed


def test_layer_without_weights_fails(tmp_path):
    """Layer 1's tensors removed; its scales stay (they once counted as the layer)."""
    files = {"model.safetensors": SHARDS["model-00001-of-00002.safetensors"] + SCALES}
    src = tiny_files.build(tmp_path / "ckpt", files)
    code, failed = _verify(src, tmp_path)
    assert code == 1
    assert any("layers 1" in f or "model.layers.1.self_attn.q_proj.weight" in f
               for f in failed), failed


def test_truncated_shard_fails(tmp_path):
    src = tiny_files.build(tmp_path / "ckpt", SHARDS, index=True)
    shard = src / "model-00002-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    code, failed = _verify(src, tmp_path)
    assert code == 1
    assert any("model-00002-of-00002.safetensors" in f and "truncated" in f
               for f in failed), failed


def test_shard_missing_from_multi_shard_index_fails(tmp_path):
    src = tiny_files.build(tmp_path / "ckpt", SHARDS, index=True)
    (src / "model-00002-of-00002.safetensors").unlink()
    code, failed = _verify(src, tmp_path)
    assert code == 1
    assert any("model-00002-of-00002.safetensors" in f and "missing" in f
               for f in failed), failed


@pytest.mark.parametrize("indexed", [True, False])
def test_git_lfs_pointer_instead_of_shard_fails(indexed, tmp_path):
    files = SHARDS if indexed else {"model.safetensors": WEIGHTS + SCALES}
    src = tiny_files.build(tmp_path / "ckpt", files, index=indexed)
    name = "model-00002-of-00002.safetensors" if indexed else "model.safetensors"
    (src / name).write_text(
        "version https://git-lfs.github.com/spec/v1\n"
        "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
        "size 269060552\n")
    code, failed = _verify(src, tmp_path)
    assert code == 1
    assert any(name in f and "git-LFS pointer" in f for f in failed), failed


def test_index_naming_a_tensor_in_the_wrong_shard_fails(tmp_path):
    src = tiny_files.build(tmp_path / "ckpt", SHARDS, index=True)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    code, failed = _verify(src, tmp_path)
    assert code == 1
    assert any("model.norm.weight" in f and "model-00002-of-00002.safetensors" in f
               for f in failed), failed
