"""Checkpoint indexes and truncated files: clear errors, never a wrong read."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvcalib.checkpoint import safetensors as checkpoint
from kvcalib.errors import CheckpointError


def _sharded(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    save_file({"a": np.ones(2, dtype=np.float32)}, folder / "one.safetensors")
    save_file({"b": np.zeros(3, dtype=np.float32)}, folder / "two.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}
    (folder / checkpoint.INDEX_NAME).write_text(json.dumps(index))
    return folder, index


def test_sharded_index(tmp_path):
    folder, _ = _sharded(tmp_path)
    index = checkpoint.tensor_index(folder)
    assert {k: v.file.name for k, v in index.items()} == {"a": "one.safetensors",
                                                          "b": "two.safetensors"}


@pytest.mark.parametrize("target, message", [
    ("missing.safetensors", "points to a missing file: missing.safetensors"),
    ("../outside.safetensors", "points outside the checkpoint folder: ../outside.safetensors"),
])
def test_bad_index_entries(tmp_path, target, message):
    folder, index = _sharded(tmp_path)
    save_file({"c": np.ones(1, dtype=np.float32)}, tmp_path / "outside.safetensors")
    index["weight_map"]["b"] = target
    (folder / checkpoint.INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=message.replace(".", "\\.")):
        checkpoint.tensor_index(folder)


def test_truncated_file(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"w": np.ones(1000, dtype=np.float32)}, path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"t\.safetensors: truncated"):
        checkpoint.file_tensors(tmp_path, path.name)
    path.write_bytes(struct.pack("<Q", 10**12) + data[8:])
    with pytest.raises(CheckpointError, match="not a safetensors file, or truncated"):
        checkpoint.file_tensors(tmp_path, path.name)
