"""`kvcalib verify --static-only` on the other layouts it reads, and on what it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from conftest import failures, run_kvcalib, verify_static
from tiny_files import complete_weights


def _fake_checkpoint(folder: Path, quantization: dict, tensors: dict) -> Path:
    """Two attention layers of a GQA model: config.json, weight stand-ins, the scales."""
    folder.mkdir()
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 2, "hidden_size": 512, "torch_dtype": "bfloat16",
              "quantization_config": quantization}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({**complete_weights(config), **tensors}, folder / "model.safetensors")
    return folder


def test_modelopt_and_fp8_layouts(tmp_path):
    def scale():
        return np.array(0.03, dtype=np.float32)

    modelopt = {f"model.layers.{i}.self_attn.{k}_proj.{k}_scale": scale() for i in (0, 1)
                for k in "kv"}
    ckpt = _fake_checkpoint(tmp_path / "modelopt", {"quant_method": "modelopt",
                                                    "kv_cache_quant_algo": "FP8"}, modelopt)
    code, report, stdout = verify_static(ckpt, tmp_path)
    assert report["scheme"]["layout"] == "modelopt"
    assert code == 1 and failures(report) == [  # vLLM 0.32 refuses it
        "config.json has no quant_algo: vLLM 0.32 refuses the checkpoint (\"Missing "
        "'quant_algo' in quantization config\"); ModelOpt leaves it out when it quantizes "
        "only the KV cache"]
    ckpt = _fake_checkpoint(tmp_path / "modelopt-fp8", {
        "quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}, modelopt)
    code, report, stdout = verify_static(ckpt, tmp_path)
    assert code == 0, stdout
    fp8 = {f"model.layers.{i}.self_attn.{k}_scale": scale() for i in (0, 1) for k in "kv"}
    del fp8["model.layers.1.self_attn.v_scale"]
    ckpt = _fake_checkpoint(tmp_path / "fp8", {"quant_method": "fp8"}, fp8)
    code, report, _ = verify_static(ckpt, tmp_path)
    assert code == 1 and failures(report) == ["layer 1: no v_scale tensor; vLLM would use 1.0"]


def test_unknown_format_is_unsupported_not_a_pass(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "gptq", {"quant_method": "gptq", "bits": 4},
                            {"x": np.zeros(1, dtype=np.float32)})
    code, report, _ = verify_static(ckpt, tmp_path)
    assert code == 1 and failures(report)[0].startswith("unsupported checkpoint format: "
                                                        "quant_method 'gptq'")


def test_missing_folder_is_a_usage_error(tmp_path):
    result = run_kvcalib("verify", tmp_path / "nope", "--static-only")
    assert result.returncode == 2 and "checkpoint folder not found" in result.stderr
