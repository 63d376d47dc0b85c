"""Independent recomputation of what calibration should measure.

Plain transformers forward passes, no llm-compressor, no compressed-tensors hooks and
no kvcalib code: keys and values are read from the model's own KV cache, queries are
recomputed from the attention inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DynamicCache

FP8_E4M3_MAX = 448.0


def _load(model_dir: Path, dtype: str, attention: str = "eager"):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                 attn_implementation=attention)
    return model.eval()


def _update(result: dict, key, amax: torch.Tensor) -> None:
    result[key] = amax if key not in result else torch.maximum(result[key], amax)


@torch.no_grad()
def kv_absmax_per_sample(model_dir: Path, token_ids: list[list[int]], dtype: str,
                         model=None) -> list[dict]:
    """For each sample: {(layer, "k"|"v"): per-KV-head absmax}, post-RoPE (of `model`
    when given, else of the checkpoint in `model_dir`)."""
    model = model if model is not None else _load(model_dir, dtype)
    result = []
    for ids in token_ids:
        cache = _cache_keeping_every_token(model)
        model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
        result.append({(layer, kind): states.abs().amax(dim=(0, 2, 3)).float()
                       for layer, entry in enumerate(cache.layers)
                       if isinstance(getattr(entry, "keys", None), torch.Tensor)
                       for kind, states in (("k", entry.keys), ("v", entry.values))})
    return result


def _cache_keeping_every_token(model) -> DynamicCache:
    """Without a config every layer keeps all tokens, sliding-window layers too. Hybrid
    models (Mamba, linear attention) need their config's cache layers; none of their
    attention layers slides."""
    cache = DynamicCache(config=model.config)
    plain = ("DynamicLayer", "DynamicSlidingWindowLayer")
    return cache if any(type(layer).__name__ not in plain for layer in cache.layers) \
        else DynamicCache()


def kv_absmax(model_dir: Path, token_ids: list[list[int]], dtype: str, model=None,
              attention: str = "eager") -> dict:
    """{(layer, "k"|"v"): per-KV-head absmax} over all samples, post-RoPE, under
    `attention` (transformers' attn_implementation) unless `model` is given."""
    model = model if model is not None else _load(model_dir, dtype, attention)
    result: dict = {}
    for sample in kv_absmax_per_sample(model_dir, token_ids, dtype, model):
        for key, amax in sample.items():
            _update(result, key, amax)
    return result


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.no_grad()
def q_absmax(model_dir: Path, token_ids: list[list[int]], dtype: str,
             attention: str = "eager") -> dict:
    """{(layer, "q"): per-head absmax} of the post-RoPE queries (Llama-style attention)."""
    model = _load(model_dir, dtype, attention)
    result: dict = {}
    handles = []
    for layer, block in enumerate(model.model.layers):
        def capture(attn, args, kwargs, layer=layer):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cos, sin = kwargs["position_embeddings"]
            q = attn.q_proj(hidden).view(*hidden.shape[:-1], -1, attn.head_dim).transpose(1, 2)
            q = q * cos.unsqueeze(1) + _rotate_half(q) * sin.unsqueeze(1)
            _update(result, (layer, "q"), q.abs().amax(dim=(0, 2, 3)).float())

        handles.append(block.self_attn.register_forward_pre_hook(capture, with_kwargs=True))
    for ids in token_ids:
        model(torch.tensor([ids]))
    for handle in handles:
        handle.remove()
    return result


def expected_scale(absmax: torch.Tensor, strategy: str, dtype: torch.dtype) -> torch.Tensor:
    """absmax / 448 per head (attn_head) or over all heads (tensor), in the stored dtype."""
    values = absmax if strategy == "attn_head" else absmax.max().reshape(1)
    return (values / FP8_E4M3_MAX).to(dtype)


def saved_scales(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every *_scale tensor of a checkpoint, read with the safetensors library."""
    index_file = ckpt / "model.safetensors.index.json"
    if index_file.exists():
        index = json.loads(index_file.read_text())["weight_map"]
    else:  # a lone model.safetensors, as save_pretrained writes small models
        with safe_open(ckpt / "model.safetensors", "pt") as f:
            index = dict.fromkeys(f.keys(), "model.safetensors")
    scales = {}
    for name, file in index.items():
        if name.endswith(("k_scale", "v_scale", "q_scale")):
            with safe_open(ckpt / file, "pt") as f:
                scales[name] = f.get_tensor(name)
    return scales


def sample_token_ids(ckpt: Path) -> list[list[int]]:
    """The calibration samples, re-tokenized from the report's row indices."""
    from transformers import AutoTokenizer

    from kvcalib.data import DatasetSpec, load_rows

    report = json.loads((ckpt / "kvcalib_report.json").read_text())
    ds = report["dataset"]
    rows = load_rows(DatasetSpec(ds["source"], ds["config"], ds["split"]))
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    max_len = report["samples"]["max_seq_len"]
    return [tokenizer(rows[i][ds["text_column"]], truncation=True, max_length=max_len)["input_ids"]
            for i in report["dataset"]["rows_used"]]


def _unpack_int4(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """compressed-tensors' pack-quantized int4: eight values per int32, lowest bits first,
    stored with an offset of 8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return (nibbles.reshape(packed.shape[0], -1)[:, :columns] - 8).float()


def dequantized_model(quantized_dir: Path, unquantized_dir: Path, dtype: str):
    """The unquantized model with every Linear weight replaced by its quantized value
    (stored integers or FP8 times their scales), read from `quantized_dir` with the
    safetensors library: no compressed-tensors, no activation quantization."""
    model = _load(unquantized_dir, dtype)
    with safe_open(quantized_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear) or f"{name}.weight_scale" not in names:
                continue
            scale = f.get_tensor(f"{name}.weight_scale").float()
            if f"{name}.weight_packed" in names:
                values = _unpack_int4(f.get_tensor(f"{name}.weight_packed"),
                                      module.in_features)
                scale = scale.repeat_interleave(module.in_features // scale.shape[1], dim=1)
            else:
                values = f.get_tensor(f"{name}.weight").float()
            module.weight.data = (values * scale).to(module.weight.dtype)
    return model
