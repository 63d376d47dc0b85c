"""Reading safetensors without loading weights, checked against the safetensors library."""

from __future__ import annotations

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kvcalib.checkpoint import safetensors as checkpoint


def _tensors():
    torch.manual_seed(0)
    x = torch.randn(4, 3) * 100
    return {
        "bf16": x.to(torch.bfloat16), "f16": x.to(torch.float16), "f32": x,
        "i64": torch.arange(6).reshape(2, 3),
        # every byte pattern of both FP8 formats
        "e4m3": torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn),
        "e5m2": torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2),
        "scalar": torch.tensor(0.25),
    }


def test_read_tensor_matches_safetensors(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file(_tensors(), path)
    infos = checkpoint.file_tensors(tmp_path, path.name)
    with safe_open(path, "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            want = f.get_tensor(name)
            want = want.to(torch.float64) if want.is_floating_point() else want
            got = checkpoint.read_tensor(infos[name])
            assert got.shape == tuple(want.shape), name
            np.testing.assert_array_equal(got, want.numpy(), err_msg=name)


def test_copy_tensors_drops_and_keeps_bytes(tmp_path):
    src, dst = tmp_path / "src.safetensors", tmp_path / "dst.safetensors"
    tensors = _tensors()
    save_file(tensors, src, metadata={"format": "pt"})
    checkpoint.copy_tensors(tmp_path, src.name, dst, drop={"f32", "scalar"})
    with safe_open(dst, "pt") as f:
        assert set(f.keys()) == set(tensors) - {"f32", "scalar"}
        assert f.metadata() == {"format": "pt"}
        for name in f.keys():  # noqa: SIM118
            assert torch.equal(f.get_tensor(name).view(torch.uint8),
                               tensors[name].contiguous().view(torch.uint8))
