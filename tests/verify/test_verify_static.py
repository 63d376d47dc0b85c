"""`kvcalib verify --static-only` on a good checkpoint and on corrupted copies of it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import INDEX, SCALES, copy_checkpoint, failures, verify_static


def test_good_checkpoint_passes(smol_attn_head, tmp_path):
    code, report, stdout = verify_static(smol_attn_head, tmp_path)
    assert code == 0, stdout
    scale_checks = [c for c in report["checks"] if c["group"] == "scales"]
    assert len(scale_checks) == 60 and all(c["status"] == "pass" for c in scale_checks)
    layer3 = next(c for c in scale_checks if c["tensor"] == "model.layers.3.self_attn.v_scale")
    want = load_file(smol_attn_head / SCALES)["model.layers.3.self_attn.v_scale"]
    assert layer3["value"] == want.flatten().float().tolist()
    assert "Result: PASS (exit code 0)" in stdout
    junit = (tmp_path / "v.xml").read_text()
    assert 'failures="0"' in junit and junit.count("<testcase") == len(report["checks"])


def _set(name: str, head: int, value: float):
    def edit(scales):
        scales[name].view(-1)[head] = value
    return edit


K3 = "model.layers.3.self_attn.k_scale"


@pytest.mark.parametrize("edit, message", [
    (_set(K3, 1, float("nan")), f"{K3}: non-finite value"),
    (_set(K3, 0, float("inf")), f"{K3}: non-finite value"),
    (_set(K3, 2, 0.0), f"{K3}: value"),
    (_set(K3, 0, -0.02), f"{K3}: value"),
    (_set(K3, 1, 1e-39), "is a denormal: uninitialized memory"),
    (_set(K3, 1, 3e38), "outside [1e-06, 1e+06] that real activations reach"),
    (lambda s: s.update({K3: torch.tensor([0.02], dtype=torch.bfloat16)}),
     f"{K3}: shape [1] holds 1 values; the strategy needs 3 values (one per head)"),
    (lambda s: s.pop("model.layers.7.self_attn.v_scale"),
     "layer 7: no v_scale tensor; vLLM would use 1.0"),
], ids=["nan", "inf", "zero", "negative", "1e-39", "3e38", "shape", "missing-layer"])
def test_corrupted_scales_fail_precisely(edit, message, smol_attn_head, tmp_path):
    ckpt = copy_checkpoint(smol_attn_head, tmp_path / "ckpt", edit)
    code, report, stdout = verify_static(ckpt, tmp_path)
    assert code == 1, stdout
    assert any(message in m for m in failures(report)), failures(report)
    assert len(failures(report)) == 1, failures(report)  # only the broken tensor
    bad = next(c for c in report["checks"] if c["status"] == "fail")
    assert bad["layer"] in (3, 7)


def test_zero_and_negative_are_named(smol_attn_head, tmp_path):
    ckpt = copy_checkpoint(smol_attn_head, tmp_path / "ckpt", _set(K3, 2, 0.0))
    (message,) = failures(verify_static(ckpt, tmp_path)[1])
    assert "is not positive" in message and ", 0.0]" in message


def test_truncated_shard(smol_attn_head, tmp_path):
    ckpt = copy_checkpoint(smol_attn_head, tmp_path / "ckpt")
    data = (ckpt / SCALES).read_bytes()
    (ckpt / SCALES).write_bytes(data[: len(data) - 64])
    code, report, _ = verify_static(ckpt, tmp_path)
    assert code == 1 and failures(report) == [
        f"{SCALES}: truncated: its header declares {len(data)} bytes, the file has "
        f"{len(data) - 64}"]


@pytest.mark.parametrize("target, message", [
    ("gone.safetensors", "points to a missing file: gone.safetensors"),
    ("../kv_scales.safetensors", "points outside the checkpoint folder: ../kv_scales.safetensors"),
])
def test_bad_index(target, message, smol_attn_head, tmp_path):
    ckpt = copy_checkpoint(smol_attn_head, tmp_path / "ckpt")
    shutil.copyfile(ckpt / SCALES, tmp_path / SCALES)
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"]["model.layers.0.self_attn.k_scale"] = target
    (ckpt / INDEX).write_text(json.dumps(index))
    code, report, _ = verify_static(ckpt, tmp_path)
    assert code == 1 and any(message in m for m in failures(report))


def test_all_ones_are_placeholders(smol_attn_head, tmp_path):
    def ones(scales):
        for name in scales:
            scales[name] = torch.ones_like(scales[name])
    code, report, _ = verify_static(copy_checkpoint(smol_attn_head, tmp_path / "c", ones), tmp_path)
    assert code == 1 and any("exactly 1.0: placeholders" in m for m in failures(report))


def test_uncalibrated_model_fails(demo_model, tmp_path):
    code, report, _ = verify_static(demo_model, tmp_path)
    assert code == 1 and any("declares no KV-cache quantization" in m for m in failures(report))
