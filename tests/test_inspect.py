"""`kvcalib inspect`: the scales shown are the checkpoint's tensors, read independently here
with safetensors; ratios and flags are recomputed by hand; plots are real PNG files."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import save_file

from conftest import linked_copy, run_kvcalib

FP8_MAX = 448.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _inspect_json(ckpt, *args) -> dict:
    result = run_kvcalib("inspect", ckpt, "--json", "-", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


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
    report = _inspect_json(smol_attn_head)
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
    report = _inspect_json(smol_tensor_q, "--outlier-ratio", 2)
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
    report = _inspect_json(smol_tensor_q, "--plot", path)  # JSON and the plot together
    assert report["strategy"] == "tensor"
    width, height = _png_size(path)
    assert width > 300 and height > 200
    assert path.stat().st_size > 15_000


def test_without_report(smol_attn_head, tmp_path):
    """Only config and scales are needed: links to everything but the report."""
    ckpt = linked_copy(smol_attn_head, tmp_path / "ckpt", leave_out=("kvcalib_report.json",))
    report = _inspect_json(ckpt)
    assert report["calibration"] is None
    _check_values(report, _tensors(smol_attn_head))
    text = run_kvcalib("inspect", ckpt).stdout
    assert "Calibration: no kvcalib_report.json in the checkpoint" in text


def test_report_from_another_run_is_pointed_out(smol_attn_head, tmp_path):
    ckpt = linked_copy(smol_attn_head, tmp_path / "ckpt", leave_out=("kvcalib_report.json",))
    report = json.loads((smol_attn_head / "kvcalib_report.json").read_text())
    report["layers"][2]["v_scale"] = [s * 2 for s in report["layers"][2]["v_scale"]]
    (ckpt / "kvcalib_report.json").write_text(json.dumps(report))
    shown = _inspect_json(ckpt)
    assert shown["problems"] == ["kvcalib_report.json disagrees with the scale tensors at 1 "
                                 "scales (layer 2 v): it does not describe this checkpoint's "
                                 "scales"]


def test_modelopt_hybrid_checkpoint(tmp_path):
    """Another layout verify reads (ModelOpt names, hf_quant_config.json) on a Jamba-style
    model whose attention layers are 1, 3, 5, 7, 9; layer 7's k scale is 5x the median."""
    config = {"architectures": ["JambaForCausalLM"], "model_type": "jamba",
              "num_hidden_layers": 10, "attn_layer_period": 2, "attn_layer_offset": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
              "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    k = {1: 0.02, 3: 0.021, 5: 0.019, 7: 0.1, 9: 0.02}
    tensors = {"model.embed_tokens.weight": np.zeros((8, 64), dtype=np.float32)}
    for layer, value in k.items():
        prefix = f"model.layers.{layer}.self_attn"
        tensors[f"{prefix}.k_proj.k_scale"] = np.array(value, dtype=np.float32)
        tensors[f"{prefix}.v_proj.v_scale"] = np.array(0.01, dtype=np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    report = _inspect_json(tmp_path)
    assert report["layout"] == "modelopt" and report["strategy"] == "tensor"
    assert [layer["layer"] for layer in report["layers"]] == [1, 3, 5, 7, 9]
    stored = {layer: float(np.float32(value)) for layer, value in k.items()}
    median = float(np.float32(0.02))
    assert report["median"]["k"] == median
    layer7 = report["layers"][3]["kinds"]["k"]
    assert layer7["scale"] == [stored[7]]
    assert layer7["absmax"] == [pytest.approx(stored[7] * FP8_MAX)]
    assert layer7["ratio"] == [pytest.approx(stored[7] / median)]
    assert [(o["layer"], o["kind"], o["head"]) for o in report["outliers"]] == [(7, "k", None)]
    table = run_kvcalib("inspect", tmp_path).stdout
    row7 = next(line for line in table.splitlines() if line.split()[:1] == ["7"])
    assert row7.endswith("k x5.00")


def test_not_a_calibrated_checkpoint(demo_model, tmp_path):
    result = run_kvcalib("inspect", demo_model)
    assert result.returncode == 2
    assert "no KV scales to inspect" in result.stderr
    assert "declares no KV-cache quantization" in result.stderr
    result = run_kvcalib("inspect", tmp_path / "missing")
    assert result.returncode == 2 and "checkpoint folder not found" in result.stderr
    assert "Traceback" not in result.stderr
