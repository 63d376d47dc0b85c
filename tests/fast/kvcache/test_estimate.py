"""`kvcalib estimate`: KV bytes of real model configs, against hand-computed numbers.

Every config below copies the fields of the model's real config.json. Expected values are
written out as M = 2·L·H_kv·d·b arithmetic here, never taken from kvcalib's output.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from conftest import assert_error, run_kvcalib
from kvcalib.errors import UsageError
from kvcalib.kvcache import capacity, geometry
from kvcalib.kvcache.capacity import Kivi
from kvcalib.kvcache.summary import estimate_summary

GiB = 2**30

LLAMA3_8B = {  # meta-llama/Meta-Llama-3-8B: GQA, 8 KV heads
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "vocab_size": 128256,
}
LLAMA2_7B = {  # meta-llama/Llama-2-7b-hf: MHA, float16
    "architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "rms_norm_eps": 1e-05, "torch_dtype": "float16", "vocab_size": 32000,
}
GPT2 = {  # openai-community/gpt2: MHA under GPT-2's own field names, no KV-head field
    "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
    "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
    "n_positions": 1024, "vocab_size": 50257,
}
FALCON_7B = {  # tiiuae/falcon-7b: MQA by multi_query
    "architectures": ["FalconForCausalLM"], "bias": False, "hidden_size": 4544,
    "model_type": "falcon", "multi_query": True, "new_decoder_architecture": False,
    "num_attention_heads": 71, "num_hidden_layers": 32, "parallel_attn": True,
    "torch_dtype": "bfloat16", "vocab_size": 65024,
}
FALCON_40B = {  # tiiuae/falcon-40b: grouped KV heads under the new decoder architecture
    "architectures": ["RWForCausalLM"], "hidden_size": 8192, "model_type": "RefinedWeb",
    "n_head": 128, "n_head_kv": 8, "n_layer": 60, "new_decoder_architecture": True,
    "parallel_attn": True, "torch_dtype": "bfloat16", "vocab_size": 65024,
}
MISTRAL_NEMO = {  # mistralai/Mistral-Nemo-Base-2407: head_dim 128, not 5120 / 32 = 160
    "architectures": ["MistralForCausalLM"], "head_dim": 128, "hidden_size": 5120,
    "intermediate_size": 14336, "max_position_embeddings": 1024000, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
    "rope_theta": 1000000.0, "sliding_window": None, "torch_dtype": "bfloat16",
    "vocab_size": 131072,
}
GEMMA_7B = {  # google/gemma-7b: head_dim 256, not 3072 / 16 = 192
    "architectures": ["GemmaForCausalLM"], "head_dim": 256, "hidden_size": 3072,
    "intermediate_size": 24576, "max_position_embeddings": 8192, "model_type": "gemma",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 16,
    "torch_dtype": "bfloat16", "vocab_size": 256000,
}
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3: MLA, 512 + 64 latent dims
    "architectures": ["DeepseekV3ForCausalLM"], "first_k_dense_replace": 3,
    "hidden_size": 7168, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "model_type": "deepseek_v3", "n_routed_experts": 256, "num_attention_heads": 128,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "torch_dtype": "bfloat16", "vocab_size": 129280,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                            "quant_method": "fp8", "weight_block_size": [128, 128]},
}
DEEPSEEK_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite: MLA without q compression
    "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "num_attention_heads": 16, "num_hidden_layers": 27, "num_key_value_heads": 16,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "torch_dtype": "bfloat16", "vocab_size": 102400,
}
MISTRAL_7B_V01 = {  # mistralai/Mistral-7B-v0.1: every layer a 4096-token sliding window
    "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rope_theta": 10000.0,
    "sliding_window": 4096, "torch_dtype": "bfloat16", "vocab_size": 32000,
}
GEMMA2_9B = {  # google/gemma-2-9b: local/global alternating, no layer_types, float32
    "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0,
    "cache_implementation": "hybrid", "final_logit_softcapping": 30.0, "head_dim": 256,
    "hidden_size": 3584, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "gemma2", "num_attention_heads": 16, "num_hidden_layers": 42,
    "num_key_value_heads": 8, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_size": 4096, "torch_dtype": "float32", "vocab_size": 256000,
}
GEMMA3_1B = {  # google/gemma-3-1b-it: 5 local layers per global one, MQA
    "architectures": ["Gemma3ForCausalLM"], "head_dim": 256, "hidden_size": 1152,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "query_pre_attn_scalar": 256, "rope_local_base_freq": 10000, "rope_theta": 1000000,
    "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
    "vocab_size": 262144,
}
GEMMA3_4B = {  # google/gemma-3-4b-it: the text_config leaves out the class defaults
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                    "model_type": "gemma3_text", "num_hidden_layers": 34,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16,
                      "num_hidden_layers": 27, "patch_size": 14},
}
QWEN2_7B = {  # Qwen/Qwen2-7B-Instruct: sliding_window set but use_sliding_window false
    "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rope_theta": 1000000.0, "sliding_window": 131072, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 152064,
}
JAMBA = {  # ai21labs/Jamba-v0.1: one attention layer in 8, the rest Mamba
    "architectures": ["JambaForCausalLM"], "attn_layer_offset": 4, "attn_layer_period": 8,
    "expert_layer_offset": 1, "expert_layer_period": 2, "hidden_size": 4096,
    "intermediate_size": 14336, "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2,
    "max_position_embeddings": 262144, "model_type": "jamba", "num_attention_heads": 32,
    "num_experts": 16, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "sliding_window": None, "torch_dtype": "bfloat16", "vocab_size": 65536,
}
NEMOTRON_H_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NEMOTRON_H_8B = {  # nvidia/Nemotron-H-8B-Base-8K: Mamba-2, MLP and 4 attention layers
    "architectures": ["NemotronHForCausalLM"], "attention_head_dim": 128,
    "hidden_size": 4096, "hybrid_override_pattern": NEMOTRON_H_PATTERN,
    "intermediate_size": 21504, "mamba_head_dim": 64, "mamba_num_heads": 128,
    "max_position_embeddings": 8192, "model_type": "nemotron_h", "num_attention_heads": 32,
    "num_hidden_layers": 52, "num_key_value_heads": 8, "ssm_state_size": 128,
    "torch_dtype": "bfloat16", "vocab_size": 131072,
}
INTERNLM2_7B = {  # internlm/internlm2-chat-7b: a model type transformers does not know
    "architectures": ["InternLM2ForCausalLM"], "bias": False, "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "internlm2",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "rope_theta": 1000000, "torch_dtype": "bfloat16", "vocab_size": 92544,
}


def from_config(config, **options):
    """capacity.from_config with its options by keyword, skip layers by their old name and
    budgets in bytes."""
    if "skip_layers" in options:
        options["kv_cache_dtype_skip_layers"] = options.pop("skip_layers")
    if isinstance(options.get("budget"), int):
        options["budget"] = f"{options['budget']}B"
    return capacity.from_config(config, capacity.EstimateOptions(**options))


def _estimate(config, **options):
    result = from_config(config, **options)
    return result, {f.name: f for f in result.formats}


# ----- MHA, GQA, MQA, explicit head_dim ----- #


@pytest.mark.parametrize(("config", "kind", "dtype", "per_token"), [
    (LLAMA3_8B, "GQA", "bfloat16", 2 * 32 * 8 * 128 * 2),  # 131,072
    (LLAMA2_7B, "MHA", "float16", 2 * 32 * 32 * 128 * 2),  # 524,288
    (GPT2, "MHA", "bfloat16", 2 * 12 * 12 * 64 * 2),  # 36,864
    (FALCON_7B, "MQA", "bfloat16", 2 * 32 * 1 * 64 * 2),  # 4544 / 71 = 64 dims: 8,192
    (FALCON_40B, "GQA", "bfloat16", 2 * 60 * 8 * 64 * 2),  # 122,880
    (MISTRAL_NEMO, "GQA", "bfloat16", 2 * 40 * 8 * 128 * 2),  # 163,840
    (GEMMA_7B, "MHA", "bfloat16", 2 * 28 * 16 * 256 * 2),  # 458,752
], ids=["llama3-8b", "llama2-7b", "gpt2", "falcon-7b", "falcon-40b", "mistral-nemo", "gemma-7b"])
def test_bytes_per_token(config, kind, dtype, per_token):
    result, formats = _estimate(config, context_length=4096, batch=3)
    assert result.attention == kind
    assert [f.name for f in result.formats] == [dtype, "fp8", "kivi2"]
    assert formats[dtype].bytes_per_token == per_token
    assert formats["fp8"].bytes_per_token == per_token / 2
    assert formats[dtype].request_bytes == 4096 * per_token
    assert formats[dtype].total_bytes == 3 * 4096 * per_token
    assert formats["fp8"].total_bytes == 3 * 4096 * per_token // 2
    assert result.excluded_layers == [] and result.sliding_layers == []


def test_llama3_8b_batch_of_four_at_8k_is_4_gib():
    result, formats = _estimate(LLAMA3_8B, batch=4)
    assert result.context_length == 8192  # max_position_embeddings
    assert formats["bfloat16"].total_bytes == 4 * 2 * 32 * 8192 * 8 * 128 * 2 == 4 * GiB


def test_falcon_new_decoder_architecture_overrides_multi_query():
    """A config written with every field has multi_query (FalconConfig's default) beside
    new_decoder_architecture; vLLM then reads num_kv_heads, as for Falcon-40B."""
    config = {"model_type": "falcon", "hidden_size": 8192, "num_attention_heads": 128,
              "num_hidden_layers": 60, "num_kv_heads": 8, "multi_query": True,
              "new_decoder_architecture": True, "torch_dtype": "bfloat16"}
    assert geometry.geometry(config).num_kv_heads == 8
    assert geometry.geometry({**config, "new_decoder_architecture": False}).num_kv_heads == 1


def test_gpt2_default_length_is_n_positions():
    result, formats = _estimate(GPT2)
    assert result.context_length == 1024 and "n_positions" in result.context_source
    assert formats["bfloat16"].request_bytes == 1024 * 2 * 12 * 12 * 64 * 2


# ----- MLA ----- #


def test_mla_deepseek_v3_caches_one_latent():
    budget = 80 * 10**9
    result, formats = _estimate(DEEPSEEK_V3, budget=budget, block_size=64)
    latent = 512 + 64
    per_token = 61 * latent * 2  # 70,272 bytes: not 2·61·128·(128+64)·2 for K and V
    assert result.attention == "MLA" and result.mla_latent_dim == latent
    assert formats["bfloat16"].bytes_per_token == per_token == 70_272
    assert formats["fp8"].bytes_per_token == 61 * latent  # 1 byte per latent element
    assert formats["fp8"].request_bytes == 163_840 * 61 * latent
    assert formats["fp8"].tokens_fit == budget // (64 * 61 * latent) * 64
    assert formats["fp8"].max_concurrency == budget // (163_840 * 61 * latent)
    kivi = formats["kivi2"]
    assert (kivi.bytes_per_token, kivi.request_bytes, kivi.tokens_fit) == (None, None, None)
    assert kivi.note.startswith("n/a")


def test_mla_deepseek_v2_lite():
    _, formats = _estimate(DEEPSEEK_V2_LITE, context_length=1000)
    assert formats["bfloat16"].bytes_per_token == 27 * (512 + 64) * 2 == 31_104
    assert formats["bfloat16"].request_bytes == 1000 * 31_104


def test_mla_table_says_kivi_does_not_apply():
    text = estimate_summary(from_config(DEEPSEEK_V3, context_length=4096))
    assert "latent of 576 dims (MLA, 128 query heads)" in text
    kivi_row = next(line for line in text.splitlines() if line.startswith("kivi2"))
    assert kivi_row.split()[1:] == ["n/a", "n/a", "n/a"]
    assert "fp8: 1 byte per latent element" in text


# ----- sliding windows ----- #


def test_mistral_sliding_window_caps_every_layer():
    budget = 24 * GiB
    result, formats = _estimate(MISTRAL_7B_V01, budget=budget)
    per_layer_token = 2 * 8 * 128 * 2  # 4,096 bytes
    assert result.context_length == 32768
    assert [s["window"] for s in result.sliding_layers] == [4096] * 32
    assert formats["bfloat16"].bytes_per_token == 32 * per_layer_token  # the full-layer view
    request = 32 * 4096 * per_layer_token  # 512 MiB: the window, not 32,768 tokens
    assert formats["bfloat16"].request_bytes == request == 512 * 2**20
    assert formats["bfloat16"].tokens_fit == budget // (16 * 32 * per_layer_token) * 16
    assert formats["bfloat16"].tokens_fit == 196_608
    assert formats["bfloat16"].max_concurrency == budget // request == 48
    # shorter than the window: every layer holds the whole request
    _, short = _estimate(MISTRAL_7B_V01, context_length=1000)
    assert short["fp8"].request_bytes == 1000 * 32 * per_layer_token // 2


def test_gemma2_alternates_local_and_global_layers():
    budget = 16 * GiB
    result, formats = _estimate(GEMMA2_9B, budget=budget)
    per_layer_token = 2 * 8 * 256 * 2  # 8,192 bytes
    # transformers' Gemma2Config: even layers slide over 4096 tokens, odd layers are global
    assert [s["index"] for s in result.sliding_layers] == list(range(0, 42, 2))
    assert result.dtype == "bfloat16"  # vLLM serves this float32 checkpoint in bfloat16
    request = 21 * 8192 * per_layer_token + 21 * 4096 * per_layer_token
    assert formats["bfloat16"].request_bytes == request == 2_113_929_216
    assert formats["bfloat16"].bytes_per_token == 42 * per_layer_token
    assert formats["bfloat16"].max_concurrency == budget // request == 8
    assert formats["fp8"].max_concurrency == budget // (request // 2) == 16


def test_gemma3_five_local_layers_per_global_one():
    result, formats = _estimate(GEMMA3_1B)
    full = [5, 11, 17, 23]  # (i + 1) % 6 == 0
    assert [i for i in result.attention_layers if i not in
            {s["index"] for s in result.sliding_layers}] == full
    per_layer_token = 2 * 1 * 256 * 2  # MQA: 1,024 bytes
    assert formats["bfloat16"].request_bytes == (4 * 32768 + 22 * 512) * per_layer_token
    assert formats["bfloat16"].request_bytes == 145_752_064


def test_gemma3_without_pattern_uses_transformers_default_of_six():
    config = {k: v for k, v in GEMMA3_1B.items() if k != "sliding_window_pattern"}
    layers = geometry.geometry(config).layers
    assert [layer.index for layer in layers if layer.kind == geometry.FULL] == [5, 11, 17, 23]


def test_qwen2_window_off_means_full_attention():
    result, formats = _estimate(QWEN2_7B, context_length=32768)
    assert result.sliding_layers == []
    assert formats["bfloat16"].request_bytes == 32768 * 2 * 28 * 4 * 128 * 2


def test_missing_fields_come_from_transformers_defaults():
    """Gemma-3 4B's config.json has no head counts: they are Gemma3TextConfig's defaults
    (8 heads, 4 KV heads of 256 dims, a global layer every 6th), as vLLM reads them."""
    result, formats = _estimate(GEMMA3_4B, context_length=32768)
    assert (result.num_heads, result.num_kv_heads, result.head_dim) == (8, 4, 256)
    assert any(d.startswith("num_key_value_heads=4") for d in result.defaults)
    full = [5, 11, 17, 23, 29]
    assert len(result.sliding_layers) == 34 - len(full)
    per_layer_token = 2 * 4 * 256 * 2  # 4,096 bytes
    assert formats["bfloat16"].bytes_per_token == 34 * per_layer_token == 139_264
    request = 5 * 32768 * per_layer_token + 29 * 1024 * per_layer_token
    assert formats["bfloat16"].request_bytes == request == 792_723_456
    assert "taken from transformers' defaults" in estimate_summary(result)


# ----- hybrid models ----- #


def test_jamba_counts_only_attention_layers():
    result, formats = _estimate(JAMBA, context_length=100_000)
    assert result.attention_layers == [4, 12, 20, 28]
    assert formats["bfloat16"].bytes_per_token == 4 * 2 * 8 * 128 * 2 == 16_384
    assert formats["bfloat16"].request_bytes == 100_000 * 16_384
    excluded = [(layer["index"], layer["block_type"]) for layer in result.excluded_layers]
    assert excluded == [(i, "mamba") for i in range(32) if i not in (4, 12, 20, 28)]
    assert "not KV cache, not counted: mamba layers 0-3, 5-11, 13-19, 21-27, 29-31" in (
        estimate_summary(result))


def test_nemotron_h_excludes_mamba_and_mlp_layers():
    attention = [7, 18, 29, 40]  # the '*' in the pattern
    result, formats = _estimate(NEMOTRON_H_8B)
    assert result.attention_layers == attention
    assert result.head_dim == 128  # from attention_head_dim
    assert formats["fp8"].bytes_per_token == 4 * 2 * 8 * 128 == 8_192
    kinds = {layer["block_type"] for layer in result.excluded_layers}
    assert kinds == {"mamba", "mlp"} and len(result.excluded_layers) == 52 - 4
    # the same model as transformers 5 writes it: layers_block_type, Mamba as linear_attention
    names = {"M": "linear_attention", "-": "mlp", "*": "full_attention"}
    written = {**{k: v for k, v in NEMOTRON_H_8B.items() if k != "hybrid_override_pattern"},
               "layers_block_type": [names[c] for c in NEMOTRON_H_PATTERN]}
    assert from_config(written).attention_layers == attention


# ----- KIVI ----- #


def test_kivi_bytes_by_hand():
    """Llama-3-8B, 1,000 tokens, G = 32, R = 128, C = 8 x 128 = 1,024 channels per layer."""
    _, formats = _estimate(LLAMA3_8B, context_length=1000, kivi=Kivi(32, 128))
    channels, codes = 1024, 1024 * 2 // 8  # 256 bytes of 2-bit codes per token
    # keys: 872 tokens older than the residual make 27 full groups (864 tokens); each group
    # holds its codes and an fp16 scale and zero point per channel; 1000 - 864 = 136 tokens
    # (the 128 recent ones and 8 not filling a group) stay 16-bit.
    keys = 27 * (32 * codes + 4 * channels) + 136 * channels * 2
    # values: 872 quantized tokens, each with codes and 8 heads x 128/32 groups of scale+zero
    values = 872 * (codes + 4 * 8 * 4) + 128 * channels * 2
    assert (keys, values) == (610_304, 596_992)
    assert formats["kivi2"].request_bytes == 32 * (keys + values) == 38_633_472
    # long-context rate per layer: codes for K and V, 4·C/G key scales, 4·8·4 value scales
    assert formats["kivi2"].bytes_per_token == 32 * (2 * codes + 4 * channels / 32 + 4 * 8 * 4)
    assert formats["kivi2"].bytes_per_token == 24_576


def test_kivi_within_the_residual_is_16_bit():
    _, formats = _estimate(LLAMA3_8B, context_length=100)
    assert formats["kivi2"].request_bytes == formats["bfloat16"].request_bytes == 100 * 131_072


def test_kivi_group_and_residual_options():
    """SmolLM2's shape (C = 3 x 64 = 192) with G = 64, R = 0: no 16-bit tokens at all."""
    config = {"model_type": "llama", "num_hidden_layers": 30, "num_attention_heads": 9,
              "num_key_value_heads": 3, "head_dim": 64, "hidden_size": 576}
    _, formats = _estimate(config, context_length=640, kivi=Kivi(64, 0))
    keys = 10 * (64 * 48 + 4 * 192)  # 640 / 64 groups; 192 x 2 / 8 = 48 bytes of codes
    values = 640 * (48 + 4 * 3 * 1)  # one 64-channel group per head
    assert formats["kivi2"].request_bytes == 30 * (keys + values)


# ----- skipped layers ----- #


def test_skip_layers_stay_16_bit():
    _, formats = _estimate(LLAMA3_8B, context_length=1024, skip_layers=["0", "31"])
    per_layer = 2 * 8 * 128  # elements per token and layer
    assert formats["fp8"].bytes_per_token == 30 * per_layer + 2 * per_layer * 2 == 69_632
    assert formats["kivi2"].bytes_per_token == 30 * 768 + 2 * per_layer * 2
    assert formats["bfloat16"].bytes_per_token == 32 * per_layer * 2


def test_skip_sliding_window_layers():
    result, formats = _estimate(GEMMA2_9B, skip_layers=["sliding_window"])
    assert result.skip_layers == list(range(0, 42, 2))
    per_layer = 2 * 8 * 256
    assert formats["fp8"].bytes_per_token == 21 * per_layer * 2 + 21 * per_layer == 258_048


@pytest.mark.parametrize(("config", "skip", "message"), [
    (LLAMA3_8B, "foo", "unknown skip layer 'foo'"),
    (LLAMA3_8B, "32", "skip layer 32 is not an attention layer (attention layers: 0-31)"),
    (LLAMA3_8B, "sliding_window", "the model has no sliding-window layers"),
    (JAMBA, "0", "skip layer 0 is not an attention layer (attention layers: 4, 12, 20, 28)"),
])
def test_bad_skip_layers(config, skip, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        from_config(config, skip_layers=[skip])


# ----- every vLLM format ----- #

PHI3_MINI = {  # microsoft/Phi-3-mini-4k-instruct: head_dim 3072 / 32 = 96, MHA
    "architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "intermediate_size": 8192,
    "max_position_embeddings": 4096, "model_type": "phi3", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 32, "torch_dtype": "bfloat16",
    "vocab_size": 32064,
}


def test_every_vllm_format_on_llama3_8b():
    """Per layer, 8 KV heads of 128 dims, as vLLM's backends lay out a page:
    per-token-head: 2·128 data bytes + two fp32 scales per head; int4 half the data;
    turboquant: key (fp8 128 B, or ⌈128·bits/8⌉ + 2-byte norm) + value (⌈128·bits/8⌉ + 4),
    rounded to even, per head, with layers 0, 1, 30 and 31 in bf16 (4,096 B each);
    ultraquant: 64 code bytes + 4 scale bytes for K and for V; nvfp4: 2·8 slots of 64 + 8."""
    budget = 80 * GiB
    result, formats = _estimate(LLAMA3_8B, context_length=8192, budget=budget,
                                formats=["all"])
    bf16 = 2 * 8 * 128 * 2
    per_layer = {"fp8_per_token_head": 8 * (256 + 8), "int8_per_token_head": 8 * (256 + 8),
                 "int4_per_token_head": 8 * (128 + 8), "ultraquant_4bit": 8 * (2 * (64 + 4)),
                 "nvfp4": 2 * 8 * (64 + 8), "nvfp4_4over6": 2 * 8 * (64 + 8),
                 "turboquant_k8v4": 8 * (128 + 64 + 4), "turboquant_4bit_nc": 8 * (66 + 68),
                 "turboquant_k3v4_nc": 8 * (50 + 68), "turboquant_3bit_nc": 8 * (50 + 52)}
    assert [f.name for f in result.formats] == [
        "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", *list(per_layer)[:3], "turboquant_k8v4",
        "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "ultraquant_4bit",
        "nvfp4", "nvfp4_4over6", "kivi2"]
    assert per_layer["turboquant_k3v4_nc"] == 944 and per_layer["ultraquant_4bit"] == 1088
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        assert formats[name].bytes_per_token == 32 * bf16 // 2
    for name, size in per_layer.items():
        kept = 4 if name.startswith(("turboquant", "ultraquant")) else 0
        per_token = (32 - kept) * size + kept * bf16
        assert formats[name].bytes_per_token == per_token, name
        assert formats[name].request_bytes == 8192 * per_token
        assert formats[name].tokens_fit == budget // (16 * per_token) * 16
        assert ("keeps layers 0-1, 30-31 in bfloat16" in formats[name].note) == bool(kept)


def test_formats_the_model_cannot_use_say_why():
    _, formats = _estimate(PHI3_MINI, formats=["turboquant_k8v4", "turboquant_3bit_nc",
                                               "ultraquant_4bit", "nvfp4", "int4_per_token_head"])
    # k8v4 rotates nothing: 96 key bytes + 48 value bytes + fp16 scale and min, per head
    per_layer, bf16 = 32 * (96 + 48 + 4), 2 * 32 * 96 * 2
    assert formats["turboquant_k8v4"].bytes_per_token == 28 * per_layer + 4 * bf16
    assert formats["turboquant_3bit_nc"].bytes_per_token is None
    assert formats["turboquant_3bit_nc"].note == (
        "n/a: turboquant's Hadamard rotation needs a power-of-2 head size (this model: 96)")
    assert "power-of-2" in formats["ultraquant_4bit"].note
    assert formats["nvfp4"].note == "n/a: FlashInfer has no NVFP4 kernels for head size 96"
    assert formats["int4_per_token_head"].bytes_per_token == 32 * 32 * (96 + 8)
    _, mla = _estimate(DEEPSEEK_V3, formats=["nvfp4", "fp8"])
    assert mla["nvfp4"].note.startswith("n/a: nvfp4 is not an MLA cache format")
    assert mla["fp8"].bytes_per_token == 61 * (512 + 64)
    _, fp16 = _estimate(LLAMA2_7B, formats=["ultraquant_4bit"])
    assert fp16["ultraquant_4bit"].note == "n/a: needs a bfloat16 model (this model: float16)"


def test_skip_layers_add_to_the_boundary_layers():
    _, formats = _estimate(LLAMA3_8B, context_length=1024, skip_layers=["5", "31"],
                           formats=["turboquant_k3v4_nc", "nvfp4"])
    bf16 = 2 * 8 * 128 * 2
    assert formats["turboquant_k3v4_nc"].bytes_per_token == 27 * 944 + 5 * bf16
    assert formats["nvfp4"].bytes_per_token == 30 * 1152 + 2 * bf16


def test_unknown_format_lists_the_valid_ones():
    with pytest.raises(UsageError, match="unknown format 'fp4'; valid: all, auto, fp8, "):
        from_config(LLAMA3_8B, formats=["fp4"])


# ----- budgets ----- #


@pytest.mark.parametrize(("text", "expected"), [
    ("16", 16 * GiB), ("0.5", GiB // 2), ("16GiB", 16 * GiB), ("512MiB", 512 * 2**20),
    ("80GB", 80 * 10**9), ("1.5 gib", 3 * GiB // 2), ("2TiB", 2 * 2**40), ("4096B", 4096),
])
def test_parse_budget(text, expected):
    assert capacity.parse_budget(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "16 parsecs", "-1", "0", "0GiB", "1e3", "GiB"])
def test_bad_budget(text):
    with pytest.raises(UsageError, match="budget"):
        capacity.parse_budget(text)


# ----- bad input ----- #


@pytest.mark.parametrize("field", ["num_attention_heads", "num_hidden_layers"])
def test_missing_field_is_named(field):
    """internlm2 is remote code, unknown to transformers: nothing fills the gap."""
    assert from_config(INTERNLM2_7B, context_length=10).formats[0].request_bytes == (
        10 * 2 * 32 * 8 * 128 * 2)
    config = {k: v for k, v in INTERNLM2_7B.items() if k != field}
    with pytest.raises(UsageError, match=f"config.json has no {field}"):
        from_config(config)


def test_missing_length_asks_for_context_length():
    config = {k: v for k, v in INTERNLM2_7B.items() if k != "max_position_embeddings"}
    with pytest.raises(UsageError, match="pass --context-length"):
        from_config(config)


@pytest.mark.parametrize(("option", "value"), [("context_length", 0), ("batch", 0),
                                                ("block_size", 0)])
def test_bad_numbers(option, value):
    with pytest.raises(UsageError, match="must be at least 1"):
        from_config(LLAMA3_8B, **{option: value})


# ----- the command ----- #


def test_cli_json_on_a_config_file(tmp_path):
    path = tmp_path / "jamba.json"
    path.write_text(json.dumps(JAMBA))
    result = run_kvcalib("estimate", path, "-T", 4096, "-B", 2, "--budget", "80GB", "--json", "-")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    formats = {f["name"]: f for f in report["formats"]}
    assert formats["bfloat16"]["total_bytes"] == 2 * 4096 * 4 * 2 * 8 * 128 * 2
    assert formats["fp8"]["tokens_fit"] == 80 * 10**9 // (16 * 4 * 2 * 8 * 128) * 16
    assert report["attention_layers"] == [4, 12, 20, 28]
    assert {"index": 0, "block_type": "mamba"} in report["excluded_layers"]
    assert report["budget_bytes"] == 80 * 10**9 and report["block_size"] == 16


def test_cli_missing_field(tmp_path):
    config = {k: v for k, v in INTERNLM2_7B.items() if k != "num_key_value_heads"}
    del config["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_error(run_kvcalib("estimate", tmp_path), 2, "config.json has no num_attention_heads")


def test_cli_not_a_model(tmp_path):
    assert_error(run_kvcalib("estimate", tmp_path), 2, "has no config.json")
    (tmp_path / "config.json").write_text("{not json")
    assert_error(run_kvcalib("estimate", tmp_path), 2, "is not valid JSON")


def test_cli_hub_id_offline():
    result = run_kvcalib("estimate", "some-org/some-model",
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert_error(result, 2, "is not a local folder, and the Hugging Face Hub cannot be reached")


@pytest.mark.parametrize("asked, config, served", [
    ("auto", LLAMA3_8B, "bfloat16"),
    ("auto", LLAMA2_7B, "float16"),
    ("auto", {**LLAMA3_8B, "torch_dtype": "float32"}, "bfloat16"),  # vLLM has no fp32 cache
    ("fp8", LLAMA2_7B, "fp8"),
    ("fp8_e5m2", LLAMA3_8B, "fp8_e5m2"),
])
def test_auto_is_served_by_the_model_dtypes_name(asked, config, served):
    """bench and lm-eval name the 16-bit cache: vLLM resolves `auto` to fp8 for a checkpoint
    with a kv_cache_scheme."""
    assert geometry.served_cache_dtype(asked, config) == served
