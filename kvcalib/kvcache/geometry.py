"""What a model's config.json says about its KV cache: which layers hold one, and its shape.

Shared by `verify` (which layers need scales, of which shape), `estimate` (bytes per
token) and the formats (which apply). Reads plain dicts, so it needs no transformers and
knows no model classes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvcalib.errors import UsageError

FULL, SLIDING, NONE = "full", "sliding", "none"
SIXTEEN_BIT = ("bfloat16", "float16")
# transformers' own default when a config with a sliding window has neither layer_types nor
# sliding_window_pattern (config.json leaves out values equal to the class's defaults).
DEFAULT_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6, "cohere2": 4}
LLAMA4_TYPES = ("llama4", "llama4_text")  # chunked attention without layer_types
# Fields whose class defaults change the KV cache's shape (see complete_config).
KV_FIELDS = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "hidden_size", "kv_lora_rank", "qk_rope_head_dim", "sliding_window", "layer_types",
             "max_position_embeddings")


class MissingField(UsageError):
    """config.json leaves out a field the KV cache's shape needs (its class may default it)."""


@dataclass(frozen=True)
class Layer:
    """One decoder layer's cache: full attention, a sliding window, or none (Mamba, MLP...)."""

    index: int
    kind: str
    window: int | None = None
    block_type: str = "attention"


def cache_dtype(model_dtype: str | None) -> str:
    """The dtype of vLLM's unquantized (`auto`) cache. vLLM serves float32 checkpoints in
    bfloat16 and has no float32 cache. Named explicitly, not as "auto": for a checkpoint
    with a kv_cache_scheme vLLM resolves auto to fp8."""
    return model_dtype if model_dtype in SIXTEEN_BIT else "bfloat16"


def served_cache_dtype(kv_cache_dtype: str, config: dict[str, Any]) -> str:
    """The kv_cache_dtype to give vLLM so that it stores what was asked for: `auto` by the
    model's 16-bit dtype's name (see cache_dtype), every other name as it is."""
    return cache_dtype(geometry(config).dtype) if kv_cache_dtype == "auto" else kv_cache_dtype


@dataclass(frozen=True)
class CacheShape:
    """What decides whether a KV format applies: the per-layer KV shape, the dtype vLLM
    serves in, and whether the cache is MLA's latent."""

    num_kv_heads: int
    head_dim: int
    model_dtype: str = "bfloat16"
    mla: bool = False


@dataclass(frozen=True)
class Geometry:
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: tuple[Layer, ...]
    dtype: str
    # DeepSeek-style MLA caches one latent of kv_lora_rank + rope dims per token and layer.
    mla_latent_dim: int | None = None

    @property
    def attention_layers(self) -> list[int]:
        return [layer.index for layer in self.layers if layer.kind != NONE]

    @property
    def hybrid(self) -> bool:
        """Layers with state other than a KV cache (Mamba, linear attention): vLLM then keeps
        no boundary layers in the model dtype. MLP and MoE layers hold no state."""
        return any(layer.kind == NONE and layer.block_type not in ("mlp", "moe")
                   for layer in self.layers)

    def cache_shape(self) -> CacheShape:
        return CacheShape(self.num_kv_heads, self.head_dim, cache_dtype(self.dtype),
                          self.mla_latent_dim is not None)

    @property
    def elements_per_token_per_layer(self) -> int:
        """Cached elements for one token in one attention layer (K and V, or the latent)."""
        if self.mla_latent_dim is not None:
            return self.mla_latent_dim
        return 2 * self.num_kv_heads * self.head_dim


# vLLM 0.32 loads no KV scales into MLA layers, whatever the checkpoint names them.
MLA_SCALES_NOT_LOADED = (
    "{arch} uses multi-head latent attention (MLA), and vLLM 0.32 loads no KV scales into "
    "MLA layers: its cache-scale name mapping (vllm/model_executor/layers/quantization/"
    "base_config.py, QuantizationConfig.get_cache_scale_mapper) renames every k_scale and "
    "v_scale to <layer>.self_attn.attn.k_scale, while an MLA layer's scale is "
    "<layer>.self_attn.mla_attn.mla_attn.k_scale (vllm/model_executor/layers/mla.py, "
    "MultiHeadLatentAttentionWrapper), so maybe_remap_kv_scale_name (vllm/model_executor/"
    "model_loader/weight_utils.py) drops it with \"not found the expected name in the "
    "model\". MLA also caches one latent of {latent} values per token, scaled by k_scale "
    "alone, not the per-head keys and values llm-compressor observes. Until vLLM maps the "
    "name, serve MLA models with a 16-bit cache, or with an FP8 cache at scale 1.0 once "
    "their accuracy is checked (docs/architectures.md)")


def architecture(config: dict[str, Any]) -> str:
    """The model class config.json names (its model_type when it names none)."""
    return str((config.get("architectures") or [config.get("model_type", "?")])[0])


def unloadable_scales(config: dict[str, Any]) -> str | None:
    """Why vLLM would not load KV scales written for this model, or None. Reads only what
    the rule needs: models without attention have no KV shape, and say so elsewhere."""
    latent = mla_latent_dim(text_config(config))
    if latent is not None:
        return MLA_SCALES_NOT_LOADED.format(arch=architecture(config), latent=latent)
    return None


def mla_latent_dim(cfg: dict[str, Any]) -> int | None:
    """DeepSeek-style MLA caches one latent of kv_lora_rank + rope dims per token and layer."""
    if cfg.get("kv_lora_rank") is None:
        return None
    return config_int(cfg, "kv_lora_rank") + config_int(cfg, "qk_rope_head_dim", least=0)


def layer_number(module_name: str) -> int | None:
    """The decoder layer number in a module name such as model.layers.7.self_attn."""
    match = re.search(r"\.(\d+)\.", f".{module_name}.")
    return int(match.group(1)) if match else None


# No real model comes near this (Llama-3.1-405B has 126 layers); a config claiming more is
# corrupt or hostile, and would otherwise make every command build that many layers.
MAX_LAYERS = 4096


def _first(config: dict[str, Any], *names: str) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return None


def config_int(config: dict[str, Any], *names: str, required: bool = True,
           least: int = 1) -> int | None:
    """The first of `names` the config has, as an integer >= least; a clear error otherwise."""
    value = _first(config, *names)
    if value is None:
        if required:
            raise MissingField(f"config.json has no {names[0]} (looked for {', '.join(names)}); "
                             "cannot tell the KV cache's shape")
        return None
    name = next(n for n in names if config.get(n) is not None)
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        shown = repr(value) if isinstance(value, (int, float, bool)) else type(value).__name__
        raise UsageError(f"config.json: {name} is {shown}; it must be an integer of at least "
                         f"{least}")
    return value


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs nest the language model's config under text_config."""
    nested = config.get("text_config") or config.get("llm_config")
    return {**config, **nested} if isinstance(nested, dict) else config


def geometry(config: dict[str, Any]) -> Geometry:
    cfg = text_config(config)
    num_layers = config_int(cfg, "num_hidden_layers", "n_layer", "num_layers")
    if num_layers > MAX_LAYERS:
        raise UsageError(f"config.json declares {num_layers:,} layers; no real model has more "
                         f"than {MAX_LAYERS:,}: the config is corrupt")
    num_heads = config_int(cfg, "num_attention_heads", "n_head", "num_heads")
    # Falcon-40B/180B set new_decoder_architecture and count KV heads in num_kv_heads; only
    # older Falcon and StarCoder configs mean one KV head by multi_query (as vLLM reads them).
    if cfg.get("multi_query") and not cfg.get("new_decoder_architecture"):
        num_kv_heads = 1
    else:
        num_kv_heads = config_int(cfg, "num_key_value_heads", "n_head_kv", "num_kv_heads",
                              required=False) or num_heads
    if num_heads % num_kv_heads:
        raise UsageError(f"config.json: {num_heads} attention heads are not a multiple of "
                         f"{num_kv_heads} KV heads")
    head_dim = config_int(cfg, "head_dim", "attention_head_dim", required=False)  # Nemotron-H
    if head_dim is None:
        head_dim = config_int(cfg, "hidden_size", "n_embd", "d_model") // num_heads
        if head_dim == 0:
            raise UsageError(f"config.json: hidden size below {num_heads} heads: no head_dim")
    mla = mla_latent_dim(cfg)
    # A nested text_config may say dtype None where the outer config has it.
    dtype = str(_first(cfg, "torch_dtype", "dtype") or _first(config, "torch_dtype", "dtype")
                or "bfloat16")
    return Geometry(
        model_type=str(cfg.get("model_type", "?")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        layers=tuple(_layers(cfg, num_layers)),
        dtype=dtype,
        mla_latent_dim=mla,
    )


def _type_list(cfg: dict[str, Any], key: str) -> list[str]:
    value = cfg[key]
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise UsageError(f"config.json: {key} must be a list of layer type names")
    return value


def _layers(cfg: dict[str, Any], num_layers: int) -> list[Layer]:
    window = config_int(cfg, "sliding_window", required=False, least=0) or None  # 0: none
    if cfg.get("use_sliding_window") is False:
        window = None
    if cfg.get("layer_types"):
        types = _type_list(cfg, "layer_types")
        return [_from_type(i, t, window, cfg) for i, t in enumerate(types[:num_layers])]
    if cfg.get("model_type") in LLAMA4_TYPES and cfg.get("attention_chunk_size"):
        return [_from_type(i, t, window, cfg) for i, t in enumerate(_llama4_types(cfg, num_layers))]
    if cfg.get("layers_block_type"):  # Jamba, Granite hybrid, Nemotron 3: "attention", "mamba"
        return [_from_type(i, t, window, cfg)
                for i, t in enumerate(_type_list(cfg, "layers_block_type")[:num_layers])]
    if cfg.get("hybrid_override_pattern"):  # Nemotron-H: "*" attention, "M" Mamba, "-" MLP
        pattern = cfg["hybrid_override_pattern"]
        if not isinstance(pattern, str):
            raise UsageError("config.json: hybrid_override_pattern must be a string")
        names = {"*": "attention", "M": "mamba", "-": "mlp", "E": "moe"}
        return [Layer(i, FULL if c == "*" else NONE, block_type=names.get(c, c))
                for i, c in enumerate(pattern[:num_layers])]
    if cfg.get("attn_layer_period"):  # older Jamba configs
        period = config_int(cfg, "attn_layer_period")
        offset = config_int(cfg, "attn_layer_offset", required=False, least=0) or 0
        return [Layer(i, FULL, block_type="attention") if i % period == offset
                else Layer(i, NONE, block_type="mamba") for i in range(num_layers)]
    if window is None:
        return [Layer(i, FULL) for i in range(num_layers)]
    if cfg.get("max_window_layers") is not None:  # Qwen2: the top layers use the window
        first = config_int(cfg, "max_window_layers", least=0)
        return [Layer(i, SLIDING, window) if i >= first else Layer(i, FULL)
                for i in range(num_layers)]
    pattern = config_int(cfg, "sliding_window_pattern", required=False) or (
        DEFAULT_SLIDING_PATTERN.get(str(cfg.get("model_type"))))
    if pattern:  # Gemma-2/3, Cohere2 configs without layer_types: every pattern-th is global
        return [Layer(i, FULL) if (i + 1) % pattern == 0 else Layer(i, SLIDING, window)
                for i in range(num_layers)]
    return [Layer(i, SLIDING, window) for i in range(num_layers)]  # Mistral-style


def _llama4_types(cfg: dict[str, Any], num_layers: int) -> list[str]:
    """Llama 4's layer types when config.json lists none (it predates layer_types): vLLM's
    llama4.py gives every layer chunked attention but the NoPE layers (no_rope_layers[i] == 0),
    which attend globally. transformers' Llama4TextConfig derives no_rope_layers, when empty,
    from no_rope_layer_interval (default 4): every interval-th layer is NoPE."""
    no_rope = cfg.get("no_rope_layers")
    if not no_rope:
        interval = config_int(cfg, "no_rope_layer_interval", required=False) or 4
        no_rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
    if not isinstance(no_rope, list):
        raise UsageError("config.json: no_rope_layers must be a list of 0 and 1")
    return ["chunked_attention" if rope else "full_attention" for rope in no_rope[:num_layers]]


def _from_type(index: int, layer_type: str, window: int | None, cfg: dict[str, Any]) -> Layer:
    if layer_type in ("sliding_attention", "local_attention", "sliding_window"):
        return Layer(index, SLIDING if window else FULL, window, layer_type)
    if layer_type == "chunked_attention":  # Llama 4: attention within fixed chunks
        chunk = config_int(cfg, "attention_chunk_size", required=False)
        return Layer(index, SLIDING if chunk else FULL, chunk, layer_type)
    if layer_type in ("full_attention", "attention", "global_attention"):
        return Layer(index, FULL, None, layer_type)
    return Layer(index, NONE, None, layer_type)  # linear attention, Mamba, conv, ...


def complete_config(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The config as transformers' class for its model_type reads it, and the KV fields that
    came from that class's defaults ("name=value").

    transformers writes config.json without the values equal to its class's defaults (the
    text_config of Gemma-3 4B has no num_attention_heads), and vLLM reads configs through
    that class. Importing transformers takes seconds, so callers use this only when a field
    is missing. Unknown model types come back unchanged, with nothing filled.
    """
    if not config.get("model_type"):
        return config, []
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        full = CONFIG_MAPPING[str(config.get("model_type"))].from_dict(config).to_dict()
    except Exception:  # not installed, unknown model type, or a config the class rejects
        return config, []
    before, after = text_config(config), text_config(full)
    filled = [f"{name}={_short(after[name])}" for name in KV_FIELDS
              if before.get(name) is None and after.get(name) is not None]
    return full, filled


def _short(value: Any) -> str:
    if isinstance(value, list) and len(value) > 4:
        return f"[{len(value)} entries: {', '.join(sorted(set(map(str, value))))}]"
    return str(value)
