"""`kvcalib inspect` on another layout verify reads, with values recomputed by hand."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import inspect_json, run_kvcalib
from tiny_files import complete_weights

FP8_MAX = 448.0


def test_modelopt_hybrid_checkpoint(tmp_path):
    """Another layout verify reads (ModelOpt names, hf_quant_config.json) on a Jamba-style
    model whose attention layers are 1, 3, 5, 7, 9; layer 7's k scale is 5x the median."""
    config = {"architectures": ["JambaForCausalLM"], "model_type": "jamba",
              "num_hidden_layers": 10, "attn_layer_period": 2, "attn_layer_offset": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
              "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"},
         "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}))
    k = {1: 0.02, 3: 0.021, 5: 0.019, 7: 0.1, 9: 0.02}
    tensors = {**complete_weights(config),
               "model.embed_tokens.weight": np.zeros((8, 64), dtype=np.float32)}
    for layer, value in k.items():
        prefix = f"model.layers.{layer}.self_attn"
        tensors[f"{prefix}.k_proj.k_scale"] = np.array(value, dtype=np.float32)
        tensors[f"{prefix}.v_proj.v_scale"] = np.array(0.01, dtype=np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    report = inspect_json(tmp_path)
    assert report["layout"] == "modelopt" and report["strategy"] == "tensor"
    assert report["problems"] == []
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
