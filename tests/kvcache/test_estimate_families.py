"""`kvcalib estimate` on every family's published config against vLLM 0.32's own spec classes.

tests/vllm_spec_oracle.py runs in the serving environment and builds, for every decoder
layer, the spec vLLM's attention layer builds (Attention, ChunkedLocalAttention,
MLAAttention.get_kv_cache_spec): full attention, sliding windows (Gemma 3, gpt-oss with its
sinks), Llama 4's chunked attention, MLA's latent (DeepSeek-V3, Kimi-K2), and nothing for
linear-attention and Mamba layers (Qwen3.5, Qwen3-Next, Granite-4.0-H). The layers are read
here from the published fields as vLLM's model code reads them, not through kvcalib's
geometry.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from conftest import TESTS, serving_python
from families import FAMILIES
from kvcalib.errors import UsageError
from kvcalib.kvcache.capacity import EstimateOptions, from_config

ORACLE = TESTS / "vllm_spec_oracle.py"
BLOCK = 16
# Past every window and chunk (gpt-oss 128, Gemma 3 1024, Llama 4 8192), and inside all of
# them; multiples of the block size, so that full layers need no rounding.
CONTEXTS = (20000, 96)
DTYPES = {"auto": "bfloat16", "fp8": "fp8"}  # vLLM's kv_cache_dtype -> kvcalib's format row
NO_KV = ("linear_attention", "mamba")  # gated delta net, Mamba-2: a state per request


def vllm_layers(published: dict) -> list[dict]:
    """One descriptor per decoder layer, as vLLM's model code reads the published config."""
    count = published["num_hidden_layers"]
    if "kv_lora_rank" in published:  # deepseek_v2.py: MLA in every layer, dense or MoE
        return [{"kind": "mla", "kv_lora_rank": published["kv_lora_rank"],
                 "qk_rope_head_dim": published["qk_rope_head_dim"]}] * count
    head = {"num_kv_heads": published["num_key_value_heads"],
            "head_size": published.get("head_dim")
            or published["hidden_size"] // published["num_attention_heads"],
            "sinks": published["model_type"] == "gpt_oss"}  # OAIAttention.sinks
    if published["model_type"] == "llama4_text":
        # llama4.py: ChunkedLocalAttention unless the layer is NoPE (no_rope_layers[i] == 0,
        # which transformers' config derives as every no_rope_layer_interval-th layer).
        interval = published["no_rope_layer_interval"]
        return [{**head, "kind": "full"} if (i + 1) % interval == 0
                else {**head, "kind": "chunked", "chunk": published["attention_chunk_size"]}
                for i in range(count)]
    # Falcon-H1 and the dense and MoE families list no layer_types: attention in every layer.
    layers = []
    for kind in published.get("layer_types") or ["full_attention"] * count:
        if kind in NO_KV:
            layers.append({"kind": "none"})
        elif kind == "sliding_attention":
            layers.append({**head, "kind": "sliding", "window": published["sliding_window"]})
        else:
            assert kind in ("full_attention", "attention"), kind
            layers.append({**head, "kind": "full"})
    assert len(layers) == count
    return layers


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """One serving-environment run answers for every family. in_flight 0: what one request
    holds between steps; vLLM's startup check adds the scheduler's in-flight tokens
    (max_concurrent_batches x max_num_batched_tokens) to every windowed layer."""
    folder = tmp_path_factory.mktemp("spec_oracle")
    request = {"block_size": BLOCK, "model_dtype": "bfloat16", "kv_cache_dtypes": list(DTYPES),
               "contexts": list(CONTEXTS), "in_flight": 0,
               "families": {name: vllm_layers(family.published)
                            for name, family in FAMILIES.items()}}
    (folder / "request.json").write_text(json.dumps(request))
    done = subprocess.run([serving_python(), ORACLE, folder / "request.json",
                           folder / "result.json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((folder / "result.json").read_text())


def kvcalib_estimate(name: str, tokens: int = CONTEXTS[0]):
    """from_config on the published fields. They name no dtype (the checkpoints are bf16) and
    no max_position_embeddings, which --context-length makes unnecessary: nothing is filled
    from transformers' defaults."""
    config = {**FAMILIES[name].published, "torch_dtype": "bfloat16"}
    estimate = from_config(config, EstimateOptions(context_length=tokens, formats=list(DTYPES),
                                                   block_size=BLOCK))
    assert estimate.defaults == []
    return estimate


def row(estimate, kv_cache_dtype: str):
    return next(f for f in estimate.formats if f.name == DTYPES[kv_cache_dtype])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_layer_kinds_match_vllms_specs(vllm, name):
    """Which layers hold KV, and which hold only a window or chunk of it."""
    layers = vllm[name]["auto"]["layers"]
    estimate = kvcalib_estimate(name)
    assert estimate.attention_layers == [i for i, spec in enumerate(layers) if spec]
    assert [x["index"] for x in estimate.excluded_layers] == [
        i for i, spec in enumerate(layers) if spec is None]
    assert [x["index"] for x in estimate.sliding_layers] == [
        i for i, spec in enumerate(layers)
        if spec and spec["spec"] in ("SlidingWindowSpec", "ChunkedLocalAttentionSpec")]
    kinds = {spec["spec"] for spec in layers if spec}
    assert ("MLAAttentionSpec" in kinds) == (estimate.attention == "MLA")


@pytest.mark.parametrize("kv_cache_dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(FAMILIES))
def test_bytes_per_token_match_vllms_page_sizes(vllm, name, kv_cache_dtype):
    """Every attention layer full: the sum over layers of page_size_bytes / block_size."""
    theirs = vllm[name][kv_cache_dtype]["bytes_per_token"]
    assert row(kvcalib_estimate(name), kv_cache_dtype).bytes_per_token == theirs


@pytest.mark.parametrize("tokens", CONTEXTS)
@pytest.mark.parametrize("kv_cache_dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(FAMILIES))
def test_one_request_matches_vllms_max_memory_usage(vllm, name, kv_cache_dtype, tokens):
    """One request of T tokens, windows and chunks applied: max_memory_usage_bytes summed
    over layers. SlidingWindowSpec holds one block more than the window (a window seldom
    starts on a block boundary), even when T is inside it; kvcalib counts the tokens."""
    result = vllm[name][kv_cache_dtype]
    extra = sum(spec["page_size_bytes"] for spec in result["layers"]
                if spec and spec["spec"] == "SlidingWindowSpec")
    ours = row(kvcalib_estimate(name, tokens), kv_cache_dtype).request_bytes
    assert ours + extra == result["max_memory_usage_bytes"][str(tokens)]


def test_sliding_window_skip_leaves_llama4s_chunked_layers_quantized():
    """--kv-cache-dtype-skip-layers sliding_window: vLLM's Attention.__init__ matches it by the
    layer's sliding window, which ChunkedLocalAttention never passes (and Llama 4's config has
    none), so Llama 4 keeps every layer in fp8; Gemma 3 keeps its sliding layers 16-bit."""
    skip = EstimateOptions(context_length=CONTEXTS[0],
                           kv_cache_dtype_skip_layers=["sliding_window"])
    gemma = from_config(FAMILIES["Gemma 3"].published, skip)
    assert gemma.skip_layers == [x["index"] for x in gemma.sliding_layers]
    with pytest.raises(UsageError, match="no sliding-window layers"):
        from_config(FAMILIES["Llama 4"].published, skip)
