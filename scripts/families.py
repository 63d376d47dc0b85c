"""The model families a release ships, as published and as tiny random models.

Each family's `published` fields are the attention geometry of one released checkpoint's
config.json (the `source`; transcribed here because nothing comes from the Hub at run
time): head_dim, query and KV heads, layer types and their pattern, sliding windows,
sinks, MLA ranks, experts and RoPE. `tiny` makes it small enough for a 2-core CPU and
keeps that geometry: the same head_dim, the same ratio of query to KV heads (at least two
KV heads, so per-head scales are tested), the same layer types in the same pattern, MLA
ranks unchanged (vLLM's MLA kernels accept only DeepSeek's 512 + 64), fewer experts,
and windows and chunks cut to 32 tokens so that they act on the test's short samples.

scripts/architectures.py runs the whole matrix; tests/calibrate/test_families.py runs
every family through calibration in CI.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HUB = "https://huggingface.co"
WINDOW = 32  # sliding windows and attention chunks of the tiny models, in tokens
ATTENTION_TYPES = ("full_attention", "sliding_attention", "attention", "chunked_attention")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# Small everywhere: the demo tokenizer's vocabulary, a narrow residual stream.
TINY_COMMON = {"vocab_size": 49152, "hidden_size": 128, "intermediate_size": 128,
               "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
               "pad_token_id": None, "tie_word_embeddings": True}


@dataclass(frozen=True)
class Family:
    """One family: what its published config says, and how its tiny model differs."""

    name: str
    kind: str  # dense, MoE, hybrid, MLA, ... (the matrix's grouping)
    source: str  # the published config.json these fields come from
    published: dict[str, Any]
    tiny: dict[str, Any]
    q_scale: bool = True  # whether kvcalib's --q-scale applies (attention classes it can hook)
    notes: str = ""

    @property
    def model_type(self) -> str:
        return self.published["model_type"]

    @property
    def mla(self) -> bool:
        return "kv_lora_rank" in self.published

    def attention_layers(self) -> list[int]:
        """The tiny model's layers with a KV cache, from the layer types it declares."""
        kwargs = self.tiny_kwargs()
        types = kwargs.get("layer_types")
        if types is None:  # every layer attends (Falcon-H1: beside its Mamba mixer)
            return list(range(kwargs["num_hidden_layers"]))
        return [i for i, kind in enumerate(types) if kind in ATTENTION_TYPES]

    def tiny_kwargs(self) -> dict[str, Any]:
        """The tiny model's config: the published geometry, then the tiny sizes."""
        kwargs = {**self.published, **TINY_COMMON, **self.tiny}
        kwargs.pop("model_type")
        return kwargs


def _layer_types(pattern: list[str], count: int) -> list[str]:
    return [pattern[i % len(pattern)] for i in range(count)]


# Kimi-K2 is DeepSeek-V3's architecture with other sizes.
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "hidden_size": 7168, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
    "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
    "rope_parameters": {"rope_type": "yarn", "factor": 40.0, "rope_theta": 10000.0,
                        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}}

FAMILIES: dict[str, Family] = {family.name: family for family in [
    Family(
        "Llama 3", "dense", f"{HUB}/meta-llama/Llama-3.1-8B/blob/main/config.json",
        {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}},
        {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2}),
    Family(
        "Qwen3", "dense", f"{HUB}/Qwen/Qwen3-8B/blob/main/config.json",
        {"model_type": "qwen3", "num_hidden_layers": 36, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
        {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2},
        notes="q_norm and k_norm before RoPE"),
    Family(
        "Gemma 3", "sliding window", f"{HUB}/google/gemma-3-4b-it/blob/main/config.json",
        {"model_type": "gemma3_text", "num_hidden_layers": 34, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 2560,
         "sliding_window": 1024, "query_pre_attn_scalar": 256,
         "layer_types": _layer_types(["sliding_attention"] * 5 + ["full_attention"], 34)},
        {"num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
         "sliding_window": WINDOW,
         "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
        notes="5 sliding-window layers : 1 global"),
    Family(
        "Phi-4", "dense", f"{HUB}/microsoft/phi-4/blob/main/config.json",
        {"model_type": "phi3", "num_hidden_layers": 40, "num_attention_heads": 40,
         "num_key_value_heads": 10, "hidden_size": 5120,
         "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}},
        # Phi-3's head_dim is hidden_size / heads: 512 / 4 = 128, as published (5120 / 40).
        {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
         "hidden_size": 1024},
        notes="fused qkv_proj"),
    Family(
        "Qwen3-MoE", "MoE", f"{HUB}/Qwen/Qwen3-30B-A3B/blob/main/config.json",
        {"model_type": "qwen3_moe", "num_hidden_layers": 48, "num_attention_heads": 32,
         "num_key_value_heads": 4, "head_dim": 128, "hidden_size": 2048, "num_experts": 128,
         "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
        {"num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 2,
         "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}),
    Family(
        "gpt-oss", "MoE, sliding window, sinks", f"{HUB}/openai/gpt-oss-20b/blob/main/config.json",
        {"model_type": "gpt_oss", "num_hidden_layers": 24, "num_attention_heads": 64,
         "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 2880,
         "sliding_window": 128, "num_local_experts": 32, "num_experts_per_tok": 4,
         "layer_types": _layer_types(["sliding_attention", "full_attention"], 24),
         "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                             "original_max_position_embeddings": 4096}},
        {"num_hidden_layers": 2, "num_attention_heads": 16, "num_key_value_heads": 2,
         "sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2,
         "layer_types": ["sliding_attention", "full_attention"]},
        notes="learned attention sinks per head; alternating sliding and full layers"),
    Family(
        "Mixtral", "MoE", f"{HUB}/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json",
        {"model_type": "mixtral", "num_hidden_layers": 32, "num_attention_heads": 32,
         "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096,
         "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
        {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
         "num_local_experts": 4}),
    Family(
        "GLM-4.5", "MoE", f"{HUB}/zai-org/GLM-4.5/blob/main/config.json",
        {"model_type": "glm4_moe", "num_hidden_layers": 92, "num_attention_heads": 96,
         "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 5120,
         "n_routed_experts": 160, "num_experts_per_tok": 8, "n_shared_experts": 1,
         "moe_intermediate_size": 1536, "first_k_dense_replace": 3, "use_qk_norm": True,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                             "partial_rotary_factor": 0.5}},
        {"num_hidden_layers": 2, "num_attention_heads": 24, "num_key_value_heads": 2,
         "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
         "first_k_dense_replace": 1, "num_nextn_predict_layers": 0},
        notes="RoPE on half of each head"),
    Family(
        "MiniMax-M2", "MoE", f"{HUB}/MiniMaxAI/MiniMax-M2/blob/main/config.json",
        {"model_type": "minimax_m2", "num_hidden_layers": 62, "num_attention_heads": 48,
         "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 3072,
         "num_local_experts": 256, "num_experts_per_tok": 8, "rotary_dim": 64,
         "scoring_func": "sigmoid", "use_routing_bias": True,
         "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                             "partial_rotary_factor": 0.5}},
        {"num_hidden_layers": 2, "num_attention_heads": 12, "num_key_value_heads": 2,
         "num_local_experts": 4, "num_experts_per_tok": 2},
        notes="q/k norm over all heads; RoPE on 64 of 128 dims"),
    Family(
        "Qwen3.5", "hybrid (gated delta net)",
        f"{HUB}/Qwen/Qwen3.5-27B/blob/main/config.json",
        {"model_type": "qwen3_5_text", "num_hidden_layers": 64, "num_attention_heads": 24,
         "num_key_value_heads": 4, "head_dim": 256, "hidden_size": 5120,
         "layer_types": _layer_types(["linear_attention"] * 3 + ["full_attention"], 64),
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                             "partial_rotary_factor": 0.25}},
        {"num_hidden_layers": 4, "num_attention_heads": 12, "num_key_value_heads": 2,
         "layer_types": ["linear_attention"] * 3 + ["full_attention"],
         "linear_num_key_heads": 2, "linear_num_value_heads": 4},
        notes="3 gated-delta-net layers : 1 gated attention layer"),
    Family(
        "Qwen3-Next", "hybrid (gated delta net), MoE",
        f"{HUB}/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json",
        {"model_type": "qwen3_next", "num_hidden_layers": 48, "num_attention_heads": 16,
         "num_key_value_heads": 2, "head_dim": 256, "hidden_size": 2048,
         "layer_types": _layer_types(["linear_attention"] * 3 + ["full_attention"], 48),
         "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
         "shared_expert_intermediate_size": 512,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                             "partial_rotary_factor": 0.25}},
        {"num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
         "layer_types": ["linear_attention"] * 3 + ["full_attention"],
         "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 64,
         "shared_expert_intermediate_size": 64},
        notes="3 gated-delta-net layers : 1 gated attention layer"),
    Family(
        "Granite-4.0-H", "hybrid (Mamba-2), MoE",
        f"{HUB}/ibm-granite/granite-4.0-h-small/blob/main/config.json",
        {"model_type": "granitemoehybrid", "num_hidden_layers": 40, "num_attention_heads": 32,
         "num_key_value_heads": 8, "hidden_size": 4096, "position_embedding_type": "nope",
         "layer_types": _layer_types(["mamba"] * 5 + ["attention"] + ["mamba"] * 4, 40),
         "num_local_experts": 72, "num_experts_per_tok": 10, "mamba_d_state": 128,
         "mamba_d_head": 64, "mamba_n_groups": 1},
        # head_dim is hidden_size / heads: 512 / 4 = 128, as published (4096 / 32).
        {"num_hidden_layers": 10, "num_attention_heads": 8, "num_key_value_heads": 2,
         "hidden_size": 1024,
         "layer_types": ["mamba"] * 5 + ["attention"] + ["mamba"] * 4,
         "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 64,
         "mamba_n_heads": 16, "mamba_expand": 1, "mamba_d_state": 16, "mamba_chunk_size": 32},
        notes="1 attention layer in 10, no positional encoding (NoPE)"),
    Family(
        "Falcon-H1", "hybrid (parallel Mamba-2)",
        f"{HUB}/tiiuae/Falcon-H1-7B-Instruct/blob/main/config.json",
        {"model_type": "falcon_h1", "num_hidden_layers": 44, "num_attention_heads": 12,
         "num_key_value_heads": 2, "head_dim": 128, "hidden_size": 3072,
         "mamba_n_heads": 24, "mamba_d_head": 128, "mamba_d_state": 256},
        {"num_hidden_layers": 2, "num_attention_heads": 12, "num_key_value_heads": 2,
         "mamba_n_heads": 4, "mamba_d_head": 64, "mamba_d_ssm": 256, "mamba_d_state": 16,
         "mamba_chunk_size": 32},
        notes="attention and Mamba-2 side by side in every layer"),
    Family(
        "DeepSeek-V3", "MLA, MoE", f"{HUB}/deepseek-ai/DeepSeek-V3/blob/main/config.json",
        DEEPSEEK_V3,
        {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
         "q_lora_rank": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 64, "first_k_dense_replace": 1, "n_group": 2,
         "topk_group": 1},
        q_scale=False, notes="caches one latent of 512 + 64 per token and layer"),
    Family(
        "Kimi-K2", "MLA, MoE", f"{HUB}/moonshotai/Kimi-K2-Instruct/blob/main/config.json",
        {**DEEPSEEK_V3, "num_attention_heads": 64, "num_key_value_heads": 64,
         "n_routed_experts": 384, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
         "rope_parameters": {**DEEPSEEK_V3["rope_parameters"], "factor": 32.0,
                             "rope_theta": 50000.0, "beta_fast": 1.0}},
        {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
         "q_lora_rank": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 64},
        q_scale=False, notes="DeepSeek-V3's architecture with 64 heads"),
    Family(
        "Llama 4", "chunked attention, NoPE, MoE",
        f"{HUB}/meta-llama/Llama-4-Scout-17B-16E-Instruct/blob/main/config.json",
        {"model_type": "llama4_text", "num_hidden_layers": 48, "num_attention_heads": 40,
         "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 5120,
         "attention_chunk_size": 8192, "no_rope_layer_interval": 4, "use_qk_norm": True,
         "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
         "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                             "original_max_position_embeddings": 8192}},
        {"num_hidden_layers": 4, "num_attention_heads": 10, "num_key_value_heads": 2,
         "attention_chunk_size": WINDOW, "num_local_experts": 4,
         "intermediate_size_mlp": 128, "max_position_embeddings": 16384},
        notes="3 chunked-attention RoPE layers : 1 global NoPE layer"),
]}


def tiny_config(family: Family):
    """transformers' own config class for the family, built with the tiny sizes."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[family.model_type](**family.tiny_kwargs())


def build_tiny(family: Family, folder: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """Save a random-weight bf16 model of the family, with the demo tokenizer, to `folder`.

    Every tensor transformers' model has is saved, which is what vLLM's loaders expect.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_from / name, folder / name)
    return folder


def with_kv_scales(model: Path, out: Path, value: float = 0.01) -> Path:
    """A copy of `model` with a per-tensor FP8 KV scheme and k/v scales of `value` on every
    layer, named as llm-compressor names them (model.layers.N.self_attn.k_scale): what a
    checkpoint made outside kvcalib looks like, for families `run` refuses."""
    import json

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor",
                            "dynamic": False, "symmetric": True}}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    with safe_open(out / "model.safetensors", "pt") as f:
        weight_map = {name: "model.safetensors" for name in f.keys()}  # noqa: SIM118
    scales = {f"model.layers.{layer}.self_attn.{kind}_scale":
              torch.tensor([value], dtype=torch.bfloat16)
              for layer in range(config["num_hidden_layers"]) for kind in ("k", "v")}
    save_file(scales, out / "kv_scales.safetensors", metadata={"format": "pt"})
    weight_map.update({name: "kv_scales.safetensors" for name in scales})
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}, indent=2))
    return out
