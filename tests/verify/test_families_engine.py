"""vLLM on the families that stretch it: MoE, hybrid linear attention, and MLA.

One engine start each (scripts/architectures.py runs every family). The calibrated MoE
and hybrid checkpoints must verify, and every attention layer the family declares must
read back from the engine as the values in its safetensors file; the hybrid's
linear-attention layers get no scales. An MLA checkpoint made elsewhere (scales named as
llm-compressor names them) must fail, with the cause in vLLM named.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import kvcalib_run, run_verify
from families import FAMILIES, with_kv_scales
from reference import saved_scales

pytestmark = pytest.mark.engine


def _cache_args(fp8_kv_supported: bool) -> list[str]:
    """FP8 where this machine's vLLM can store it; else a bf16 cache, into which vLLM's
    compressed-tensors path loads the scales all the same."""
    return [] if fp8_kv_supported else ["--kv-cache-dtype", "bfloat16"]


@pytest.mark.parametrize("name", ["Qwen3-MoE", "Qwen3-Next"])
def test_engine_reads_back_every_attention_layers_scales(name, family_model, fp8_kv_supported,
                                                         tmp_path):
    family = FAMILIES[name]
    ckpt = tmp_path / "ckpt"
    done = kvcalib_run(family_model(name), ckpt, "--strategy", "attn_head")
    assert done.returncode == 0, done.stderr
    result = run_verify(ckpt, tmp_path, *_cache_args(fp8_kv_supported))
    assert result["returncode"] == 0, result["stdout"]
    layers = family.attention_layers()
    readback = [c for c in result["report"]["checks"] if c["group"] == "readback"]
    assert sorted(c["layer"] for c in readback) == sorted(layers * 2)  # k and v
    assert all(c["status"] == "pass" for c in readback)
    # What the engine holds, against the file read with the safetensors library.
    run = next(iter(result["report"]["engine"]["runs"].values()))
    held = {int(name.split(".")[2]): entry for name, entry in run["scales"].items()}
    assert sorted(held) == layers
    files = saved_scales(ckpt)
    for layer in layers:
        for kind in ("k", "v"):
            want = files[f"model.layers.{layer}.self_attn.{kind}_scale"].float().flatten()
            np.testing.assert_array_equal(held[layer][kind], want.numpy())


def test_mla_checkpoint_made_elsewhere_fails_with_vllms_cause(family_model, tmp_path):
    ckpt = with_kv_scales(family_model("DeepSeek-V3"), tmp_path / "llmc-style")
    result = run_verify(ckpt, tmp_path, "--kv-cache-dtype", "bfloat16")
    assert result["returncode"] == 1
    failed = [c for c in result["report"]["checks"] if c["status"] == "fail"]
    assert "QuantizationConfig.get_cache_scale_mapper" in failed[0]["message"]
    # The engine confirms it: vLLM says it did not load them.
    run = next(iter(result["report"]["engine"]["runs"].values()))
    assert run["not_loaded"], result["stdout"]
    assert "not found the expected name in the model" in run["not_loaded"][0]
