"""vLLM 0.32.0's own KV-cache spec classes as the oracle for `kvcalib estimate`. Runs in the
serving environment:

    .venv-serve/bin/python tests/vllm_spec_oracle.py REQUEST.json RESULT.json

REQUEST is {"block_size": 16, "model_dtype": "bfloat16", "kv_cache_dtypes": ["auto", "fp8"],
"contexts": [T, ...], "in_flight": N, "families": {name: [layer, ...]}}, one layer per decoder
layer: {"kind": "full" | "sliding" | "chunked" | "mla" | "none", "num_kv_heads", "head_size",
"window" (sliding), "chunk" (chunked), "kv_lora_rank" and "qk_rope_head_dim" (mla), "sinks"}.

Each layer's spec comes from the attention layer's own get_kv_cache_spec (Attention,
ChunkedLocalAttention, MLAAttention), called unbound on a stand-in with only the attributes
it reads (a real layer needs a model, weights and a backend). RESULT gives, per family and
kv_cache_dtype, each layer's spec class, page_size_bytes and block_size, the bytes per token
(page_size_bytes / block_size summed over layers) and max_memory_usage_bytes for one request
of each context length. Nothing here imports kvcalib.
"""

from __future__ import annotations

import json
import sys
from fractions import Fraction
from types import SimpleNamespace

import torch
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.layers.attention.chunked_local_attention import ChunkedLocalAttention
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend


def stand_in_config(block_size: int, model_dtype: torch.dtype, max_model_len: int,
                    in_flight: int) -> SimpleNamespace:
    """The smallest VllmConfig stand-in: the attributes get_kv_cache_spec and the specs'
    max_memory_usage_bytes read (cache_config.block_size and skip_page_size_padded, None
    without --kv-cache-dtype-skip-layers; model_config.dtype for "auto" and max_model_len;
    parallel_config.decode_context_parallel_size; max_in_flight_tokens, in a real config
    max_concurrent_batches x max_num_batched_tokens)."""
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=block_size, skip_page_size_padded=None),
        model_config=SimpleNamespace(dtype=model_dtype, max_model_len=max_model_len),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        max_in_flight_tokens=in_flight)


def layer_spec(layer: dict, kv_cache_dtype: str, config: SimpleNamespace):
    """The spec vLLM's attention layer of this kind builds, or None for layers without KV
    (linear attention and Mamba keep a MambaSpec state per request, not per token)."""
    kind = layer["kind"]
    if kind == "none":
        return None
    torch_dtype = kv_cache_dtype_str_to_dtype(kv_cache_dtype, config.model_config)
    if kind == "mla":
        # MLAAttention.__init__: head_size = kv_lora_rank + qk_rope_head_dim, one KV "head".
        stand_in = SimpleNamespace(kv_cache_dtype=kv_cache_dtype, sliding_window=None,
                                   head_size=layer["kv_lora_rank"] + layer["qk_rope_head_dim"],
                                   indexer=None, non_causal_multi_token_decode=False)
        return MLAAttention.get_kv_cache_spec(stand_in, config)
    # Attention.__init__'s attributes. gpt-oss's sinks are one learned logit per query head
    # (OAIAttention.sinks, passed as extra_impl_args["sinks"]): Attention only records
    # has_sink, and get_kv_cache_spec reads neither, so "sinks" in the request changes nothing
    # here by construction; SinkFullAttentionSpec belongs to StaticSinkAttention (sink
    # tokens, openpangu), not to gpt-oss.
    stand_in = SimpleNamespace(
        attn_type=AttentionType.DECODER, attn_backend=TritonAttentionBackend,
        kv_cache_dtype=kv_cache_dtype, kv_cache_torch_dtype=torch_dtype,
        num_kv_heads=layer["num_kv_heads"], head_size=layer["head_size"],
        head_size_v=layer["head_size"], has_sink=bool(layer.get("sinks")),
        sliding_window=layer["window"] if kind == "sliding" else None,
        attention_chunk_size=layer.get("chunk"))
    if kind == "chunked":  # Llama 4's RoPE layers (llama4.py, use_chunked_local_attn)
        return ChunkedLocalAttention.get_kv_cache_spec(stand_in, config)
    assert kind in ("full", "sliding"), kind
    return Attention.get_kv_cache_spec(stand_in, config)


def family(layers: list[dict], kv_cache_dtype: str, request: dict) -> dict:
    dtype = getattr(torch, request["model_dtype"])
    block = request["block_size"]
    base = stand_in_config(block, dtype, max(request["contexts"]), request["in_flight"])
    specs = [layer_spec(layer, kv_cache_dtype, base) for layer in layers]
    per_token = sum((Fraction(s.page_size_bytes, s.block_size) for s in specs if s), Fraction())
    assert per_token.denominator == 1, per_token
    memory = {}
    for tokens in request["contexts"]:
        config = stand_in_config(block, dtype, tokens, request["in_flight"])
        memory[str(tokens)] = sum(s.max_memory_usage_bytes(config) for s in specs if s)
    return {"bytes_per_token": int(per_token), "max_memory_usage_bytes": memory,
            "layers": [None if s is None else
                       {"spec": type(s).__name__, "page_size_bytes": s.page_size_bytes,
                        "block_size": s.block_size, "dtype": str(s.dtype)} for s in specs]}


def main(request_path: str, result_path: str) -> None:
    with open(request_path) as f:
        request = json.load(f)
    result = {name: {dtype: family(layers, dtype, request)
                     for dtype in request["kv_cache_dtypes"]}
              for name, layers in request["families"].items()}
    with open(result_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
