"""`kvcalib inspect`: the scales shown are the checkpoint's tensors, read independently here
with safetensors; ratios and flags are recomputed by hand; plots are real PNG files."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open

from conftest import inspect_json, linked_copy, run_kvcalib

FP8_MAX = 448.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _tensors(ckpt) -> dict[tuple[int, str], np.ndarray]:
    """Every k/v/q scale in the checkpoint, by (layer, kind), straight from safetensors."""
    found = {}
    for path in ckpt.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.endswith(("self_attn.k_scale", "self_attn.v_scale", "self_attn.q_scale")):
                    layer = int(name.split(".")[2])
                    found[(layer, name[-7])] = f.get_tensor(name).to(torch.float64).numpy().ravel()
    return found


def _check_values(report: dict, tensors: dict, ratio_limit: float = 4.0) -> None:
    kinds = sorted({kind for _, kind in tensors})
    median = {k: float(np.median([v.max() for (_, kind), v in tensors.items() if kind == k]))
              for k in kinds}
    assert report["median"] == pytest.approx(median, rel=1e-12)
    shown = {(layer["layer"], kind): scales for layer in report["layers"]
             for kind, scales in layer["kinds"].items()}
    assert set(shown) == set(tensors)
    expected_outliers = set()
    for key, values in tensors.items():
        assert shown[key]["scale"] == values.tolist()  # exactly the stored values
        assert shown[key]["absmax"] == pytest.approx((values * FP8_MAX).tolist(), rel=1e-12)
        ratio = values / median[key[1]]
        assert shown[key]["ratio"] == pytest.approx(ratio.tolist(), rel=1e-12)
        for head, r in enumerate(ratio):
            if r > ratio_limit or r < 1 / ratio_limit:
                expected_outliers.add((*key, head if values.size > 1 else None))
    flagged = {(o["layer"], o["kind"], o["head"]) for o in report["outliers"]
               if not o["why"].startswith("clips")}
    assert flagged == expected_outliers


def test_attn_head_values_equal_the_tensors(smol_attn_head):
    report = inspect_json(smol_attn_head)
    tensors = _tensors(smol_attn_head)
    assert len(tensors) == 30 * 2 and all(v.size == 3 for v in tensors.values())
    assert report["strategy"] == "attn_head" and report["layout"] == "compressed-tensors"
    _check_values(report, tensors)
    # the calibration report: what the scales were measured on, and absmax per head
    calibration = json.loads((smol_attn_head / "kvcalib_report.json").read_text())
    assert report["calibration"]["dataset"]["source"] == "builtin"
    assert report["calibration"]["samples"]["used"] == 6
    layer3 = report["layers"][3]["kinds"]["k"]
    assert layer3["seen_absmax"] == calibration["layers"][3]["k_absmax"]
    # static_minmax: each scale is what was seen / 448, so nothing clips
    assert not any(o["why"].startswith("clips") for o in report["outliers"])
    assert report["problems"] == []


def test_tensor_scales_with_q(smol_tensor_q):
    report = inspect_json(smol_tensor_q, "--outlier-ratio", 2)
    tensors = _tensors(smol_tensor_q)
    assert {kind for _, kind in tensors} == {"k", "v", "q"}
    assert all(v.size == 1 for v in tensors.values())
    _check_values(report, tensors, ratio_limit=2.0)
    # a per-tensor scale covers the largest absmax the report saw over its heads
    seen = json.loads((smol_tensor_q / "kvcalib_report.json").read_text())["layers"][0]
    assert report["layers"][0]["kinds"]["q"]["seen_absmax"] == [max(seen["q_absmax"])]


def test_table_per_layer_and_head(smol_attn_head):
    result = run_kvcalib("inspect", smol_attn_head, "--heads")
    assert result.returncode == 0, result.stderr
    tensors = _tensors(smol_attn_head)
    lines = result.stdout.splitlines()
    assert any(line.startswith("Calibration: builtin, 6 samples") for line in lines)
    layer0 = next(line for line in lines if line.split()[:1] == ["0"] and ".." in line)
    k0 = tensors[(0, "k")]
    assert layer0.split()[1] == f"{k0.min():.4g}..{k0.max():.4g}"
    assert layer0.split()[2] == f"{k0.max() * FP8_MAX:.4g}"
    head_rows = [line.split() for line in lines if len(line.split()) == 7
                 and line.split()[1] in ("k", "v")]
    assert len(head_rows) == 30 * 2 * 3
    v_28_0 = next(row for row in head_rows if row[:3] == ["28", "v", "0"])
    assert v_28_0[3] == f"{tensors[(28, 'v')][0]:.4g}"


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_heatmap_png(smol_attn_head, tmp_path):
    path = tmp_path / "plots" / "scales.png"
    result = run_kvcalib("inspect", smol_attn_head, "--plot", path)
    assert result.returncode == 0, result.stderr
    assert str(path) in result.stderr
    width, height = _png_size(path)
    assert width > 300 and height > 300
    assert path.stat().st_size > 20_000  # two colour panels, not an empty canvas


def test_line_plot_png(smol_tensor_q, tmp_path):
    path = tmp_path / "scales.png"
    report = inspect_json(smol_tensor_q, "--plot", path)  # JSON and the plot together
    assert report["strategy"] == "tensor"
    width, height = _png_size(path)
    assert width > 300 and height > 200
    assert path.stat().st_size > 15_000


def test_without_report(smol_attn_head, tmp_path):
    """Only config and scales are needed: links to everything but the report."""
    ckpt = linked_copy(smol_attn_head, tmp_path / "ckpt", leave_out=("kvcalib_report.json",))
    report = inspect_json(ckpt)
    assert report["calibration"] is None
    _check_values(report, _tensors(smol_attn_head))
    text = run_kvcalib("inspect", ckpt).stdout
    assert "Calibration: no kvcalib_report.json in the checkpoint" in text


def test_report_from_another_run_is_pointed_out(smol_attn_head, tmp_path):
    ckpt = linked_copy(smol_attn_head, tmp_path / "ckpt", leave_out=("kvcalib_report.json",))
    report = json.loads((smol_attn_head / "kvcalib_report.json").read_text())
    report["layers"][2]["v_scale"] = [s * 2 for s in report["layers"][2]["v_scale"]]
    (ckpt / "kvcalib_report.json").write_text(json.dumps(report))
    shown = inspect_json(ckpt)
    assert shown["problems"] == ["kvcalib_report.json disagrees with the scale tensors at 1 "
                                 "scales (layer 2 v): it does not describe this checkpoint's "
                                 "scales"]


def test_not_a_calibrated_checkpoint(demo_model, tmp_path):
    result = run_kvcalib("inspect", demo_model)
    assert result.returncode == 2
    assert "no KV scales to inspect" in result.stderr
    assert "declares no KV-cache quantization" in result.stderr
    result = run_kvcalib("inspect", tmp_path / "missing")
    assert result.returncode == 2 and "checkpoint folder not found" in result.stderr
    assert "Traceback" not in result.stderr
