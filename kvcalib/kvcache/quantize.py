"""vLLM 0.32.0's KV-cache number formats, as quantize-then-dequantize functions.

Each function takes K or V of shape (..., head_dim) and returns what the attention kernel
reads back, in float32 and in the same basis as the input (rotations are undone), so a
simulated attention can use it in place of the exact tensor. Every step follows the vLLM
(or FlashInfer) source it names: same rotations and random signs, codebooks, rounding
(round-half-away vs round-half-even, truncating stores), clamping, and inline scale
precision (fp32, fp16, E4M3, UE8M0). Paths are inside the `vllm` package unless noted.

The math is float32 IEEE throughout. GPU kernels may differ from it in the last bit where
they use approximate division (Triton's `/`, PTX rcp.approx) or fused multiply-adds; such a
difference changes a stored code only when a value lies within an ulp of a rounding
boundary.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from kvcalib.dtypes import E4M3_MAX
from kvcalib.kvcache.formats import NVFP4_BLOCK, ULTRAQUANT_GROUP, Math


def apply(how: Math, x: Tensor, scale: Any = None) -> Tensor:
    """What the attention kernel reads back of `x` stored as `how` says (a format's keys,
    values or queries); static math gets the layer's scale as one float, its largest."""
    function = globals()[how.function]
    if how.static:
        return function(x, float(torch.as_tensor(scale, dtype=torch.float32).max()),
                        **how.options)
    return function(x, **how.options)


def to_e4m3(x: Tensor) -> Tensor:
    """Round float32 to FP8 E4M3 (nearest even, saturating at ±448), as cvt.rn.satfinite."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def _round_half_away(x: Tensor) -> Tensor:
    """Triton's `where(x >= 0, x + 0.5, x - 0.5).to(int32)`: the cast truncates."""
    return torch.where(x >= 0, x + 0.5, x - 0.5).trunc()


# ----- rotations ----- #


def _sylvester(d: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The ±1 Sylvester-Hadamard matrix of order d (a power of two)."""
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@lru_cache(maxsize=16)
def orthonormal_hadamard(d: int) -> Tensor:
    """H / sqrt(d), symmetric and its own inverse (turboquant_attn._build_hadamard)."""
    return _sylvester(d) / math.sqrt(d)


@lru_cache(maxsize=16)
def _ultraquant_hadamard(d: int) -> Tensor:
    """ultraquant/reference.hadamard_matrix: normalized in float64, then float32."""
    return (_sylvester(d, torch.float64) / d**0.5).float()


def _power_of_two_block(d: int) -> int:
    """vllm.utils.math_utils.largest_power_of_2_divisor."""
    return d & -d


@lru_cache(maxsize=16)
def rht_signs(d: int) -> Tensor:
    """int4_per_token_head._get_rht_signs(d, round 0): seeded Bernoulli ±1 signs."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(0x9E3779B9)
    return 2.0 * torch.bernoulli(torch.full((d,), 0.5), generator=generator) - 1.0


def _walsh_hadamard(x: Tensor) -> Tensor:
    """Unnormalized H·x along the last dim: vLLM's PyTorch butterfly (fast_hadamard_transform,
    the CPU tier; CUDA runs the same transform in bf16 tensor cores)."""
    d = x.shape[-1]
    h = 1
    while h < d:
        pairs = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        x = torch.stack([pairs[..., 0, :] + pairs[..., 1, :],
                         pairs[..., 0, :] - pairs[..., 1, :]], dim=-2).reshape(x.shape)
        h <<= 1
    return x


def randomized_hadamard(x: Tensor, inverse: bool = False) -> Tensor:
    """int4_per_token_head.single_rht: H·D·x (inverse: D·H·x), blockwise over the largest
    power-of-two divisor b of the head size; the norm grows by sqrt(b)."""
    d = x.shape[-1]
    block = _power_of_two_block(d)
    if block < d:
        lead = x.shape[:-1]
        return randomized_hadamard(x.reshape(*lead, d // block, block), inverse).reshape(*lead, d)
    signs = rht_signs(d).to(x.device)
    return _walsh_hadamard(x) * signs if inverse else _walsh_hadamard(x * signs)


# ----- per-token-head: fp8 / int8 (v1/attention/ops/triton_reshape_and_cache_flash.py) ----- #


def per_token_head(x: Tensor, integer: bool) -> Tensor:
    """_reshape_cache_per_token_head: scale = max(absmax / QMAX, 1e-6) in fp32 per (token,
    head), stored inline; int8 rounds half away from zero then truncates into [-128, 127];
    fp8 clamps to ±448 and rounds to nearest even."""
    xf = x.float()
    qmax = 127.0 if integer else E4M3_MAX
    scale = (xf.abs().amax(-1, keepdim=True) / qmax).clamp_min(1e-6)
    y = xf * (1.0 / scale)
    q = _round_half_away(y).clamp(-128.0, 127.0) if integer else to_e4m3(y)
    return q * scale


# ----- int4 per-token-head (v1/attention/ops/int4_per_token_head.py) ----- #


def int4_codes(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """_reshape_cache_int4_kernel on already rotated values: (codes 0..15, zero point, stored
    fp32 scale whose low 4 mantissa bits were replaced by the zero point)."""
    lo = x.amin(-1, keepdim=True)
    hi = x.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15.0).clamp_min(1e-6)
    zero = _round_half_away(-lo / scale).clamp(0.0, 15.0)
    codes = _round_half_away(x * (1.0 / scale) + zero).clamp(0.0, 15.0)
    bits = (scale.view(torch.int32) & -16) | zero.to(torch.int32)
    return codes, zero, bits.view(torch.float32)


def int4_per_token_head(x: Tensor) -> Tensor:
    """reshape_and_cache_int4 + unified_attention_int4: rotate (then back to the model
    dtype), asymmetric 4-bit with the zero point hidden in the scale's mantissa; the
    attention kernel multiplies by the scale with those bits masked off, and the output
    is rotated back and divided by b."""
    rotated = randomized_hadamard(x.float()).to(x.dtype).float()
    codes, zero, packed_scale = int4_codes(rotated)
    scale = (packed_scale.view(torch.int32) & -16).view(torch.float32)
    block = _power_of_two_block(x.shape[-1])
    return randomized_hadamard((codes - zero) * scale, inverse=True) / block


# ----- TurboQuant (model_executor/layers/quantization/turboquant/,
#       v1/attention/ops/triton_turboquant_store.py, triton_turboquant_decode.py) ----- #


def _gaussian_pdf(x: float, sigma2: float) -> float:
    return (1.0 / math.sqrt(2 * math.pi * sigma2)) * math.exp(-x * x / (2 * sigma2))


def _trapz(f, a: float, b: float, n: int = 200) -> float:
    h = (b - a) / n
    total = 0.5 * (f(a) + f(b))
    for i in range(1, n):
        total += f(a + i * h)
    return total * h


@lru_cache(maxsize=32)
def lloyd_max_centroids(d: int, bits: int) -> Tensor:
    """centroids.solve_lloyd_max: Lloyd-Max levels for N(0, 1/d), the same trapezoid rule,
    start, iteration cap and tolerance, so the float32 levels come out bit for bit."""
    n_levels = 2**bits
    sigma2 = 1.0 / d
    sigma = math.sqrt(sigma2)
    lo, hi = -3.5 * sigma, 3.5 * sigma
    centroids = [lo + (hi - lo) * (i + 0.5) / n_levels for i in range(n_levels)]
    for _ in range(200):
        edges = [lo * 3, *((centroids[i] + centroids[i + 1]) / 2.0 for i in
                          range(n_levels - 1)), hi * 3]
        new = []
        for i in range(n_levels):
            a, b = edges[i], edges[i + 1]
            num = _trapz(lambda x: x * _gaussian_pdf(x, sigma2), a, b)
            den = _trapz(lambda x: _gaussian_pdf(x, sigma2), a, b)
            new.append(num / den if den > 1e-15 else centroids[i])
        if max(abs(new[i] - centroids[i]) for i in range(n_levels)) < 1e-10:
            break
        centroids = new
    return torch.tensor(centroids, dtype=torch.float32)


def turboquant_rotated_keys(x: Tensor, bits: int, norm_correction: bool) -> Tensor:
    """MSE keys as the decode kernel sees them, in the rotated basis: unit-normalize
    (norm + 1e-8), rotate by H/sqrt(d), pick the Lloyd-Max level by the sorted midpoints (a
    value on a midpoint goes up), store the norm as fp16; with norm_correction the level
    vector is re-normalized (1/sqrt(|c|² + 1e-16)) before scaling by the norm."""
    d = x.shape[-1]
    xf = x.float()
    norms = xf.norm(dim=-1, keepdim=True)
    rotated = (xf / (norms + 1e-8)) @ orthonormal_hadamard(d).to(x.device)
    centroids = lloyd_max_centroids(d, bits).to(x.device)
    ordered = centroids.sort().values
    midpoints = (ordered[:-1] + ordered[1:]) / 2
    levels = centroids[torch.bucketize(rotated, midpoints, right=True)]
    if norm_correction:
        levels = levels * (1.0 / torch.sqrt((levels * levels).sum(-1, keepdim=True) + 1e-16))
    return norms.half().float() * levels


def turboquant_keys(x: Tensor, bits: int, norm_correction: bool) -> Tensor:
    """MSE keys in the input basis: the decode kernel scores q·H/sqrt(d) against the rotated
    reconstruction, which equals q against it rotated back (H/sqrt(d) is its own inverse)."""
    pit = orthonormal_hadamard(x.shape[-1]).to(x.device)
    return turboquant_rotated_keys(x, bits, norm_correction) @ pit


def turboquant_fp8_keys(x: Tensor) -> Tensor:
    """k8v4 keys: a plain cast to E4M3 with no scale (_tq_fused_store_fp8, Hopper and later;
    Ampere/Ada store float8e4b15 instead)."""
    return to_e4m3(x.float())


def turboquant_values(x: Tensor, bits: int) -> Tensor:
    """_store_quantized_value: asymmetric min/max per (token, head) with 2^bits - 1 steps
    (step at least 1e-8), codes int((v - min) / step + 0.5) clamped; step and min are stored
    as fp16 and the decode kernel computes code · step + min in fp32."""
    xf = x.float()
    levels = float(2**bits - 1)
    lo = xf.amin(-1, keepdim=True)
    step = (xf.amax(-1, keepdim=True) - lo) / levels
    step = torch.where(step > 1e-8, step, torch.full_like(step, 1e-8))
    codes = ((xf - lo) / step + 0.5).trunc().clamp(0.0, levels)
    return codes * step.half().float() + lo.half().float()


# ----- UltraQuant (v1/attention/ops/ultraquant/reference.py, format.py) ----- #

ULTRAQUANT_C = 0.156
FP4_LEVELS = (-6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def ultraquant_encode_decode(x: Tensor, rotate: bool) -> Tensor:
    """reference.ultraquant_encode + ultraquant_dequant, in the rotated basis when rotating:
    x @ H.T (H/sqrt(d) normalized in float64), groups of 32, scale
    2^floor(log2(0.156 · absmax) + 0.5) as a UE8M0 byte (exponent clamped to [-126, 127];
    an all-zero group stores 0), FP4 E2M1 by the midpoints (a value on a midpoint goes down)."""
    d = x.shape[-1]
    xf = x.float()
    if rotate:
        xf = xf @ _ultraquant_hadamard(d).to(x.device).T
    groups = xf.unflatten(-1, (d // ULTRAQUANT_GROUP, ULTRAQUANT_GROUP))
    raw = groups.abs().amax(-1, keepdim=True) * ULTRAQUANT_C
    zero = (raw <= 0) | ~torch.isfinite(raw)
    exponent = torch.floor(torch.log2(torch.where(zero, torch.ones_like(raw), raw)) + 0.5)
    scale = torch.where(zero, torch.zeros_like(raw), torch.exp2(exponent.clamp(-126, 127)))
    levels = torch.tensor(FP4_LEVELS, device=x.device)
    midpoints = (levels[:-1] + levels[1:]) / 2
    index = torch.bucketize((groups / torch.where(zero, torch.ones_like(scale), scale))
                            .contiguous(), midpoints)
    return (levels[index] * scale).flatten(-2)


def ultraquant_keys(x: Tensor) -> Tensor:
    """Keys are stored rotated; in the input basis they are the reconstruction @ H."""
    return ultraquant_encode_decode(x, rotate=True) @ _ultraquant_hadamard(x.shape[-1]).to(
        x.device)


def ultraquant_values(x: Tensor) -> Tensor:
    """Values are not rotated."""
    return ultraquant_encode_decode(x, rotate=False)


def ultraquant_query(q: Tensor) -> Tensor:
    """The decode launcher's query: rotated by H/sqrt(d) and cast to E4M3 at scale 1
    (ultraquant/triton_unified_attention.py), then rotated back."""
    hadamard = orthonormal_hadamard(q.shape[-1]).to(q.device)
    return to_e4m3(q.float() @ hadamard) @ hadamard


# ----- NVFP4 (flashinfer 0.7.0.post1 include/flashinfer/page.cuh; csrc/nvfp4_kv_cache_kernels.cu
#       in the vLLM 0.32.0 source release) ----- #

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
# cvt.rn.satfinite.e2m1: a tie goes to the even code, so 0.25, 1.25, 2.5 and 5.0 round down
# and 0.75, 1.75 and 3.5 round up (the float32 just below them is the bin's upper edge).
_TIES_UP = torch.tensor([False, True, False, True, False, True, False])
_E2M1_BOUNDS = torch.where(
    _TIES_UP, torch.nextafter(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]),
                              torch.tensor(0.0)),
    torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]))


def to_e2m1(x: Tensor) -> Tensor:
    """Round float32 to FP4 E2M1 (nearest, ties to even, saturating at ±6)."""
    mag = _E2M1.to(x.device)[torch.bucketize(x.abs(), _E2M1_BOUNDS.to(x.device))]
    return torch.where(x < 0, -mag, mag)


def _nvfp4_candidate(blocks: Tensor, amax: Tensor, global_scale: float, top: float
                     ) -> tuple[Tensor, Tensor]:
    """Block scale E4M3(amax / (top · g)), codes of x / (scale · g): (codes, scale · g)."""
    scale = to_e4m3(amax / (top * global_scale))
    dequant = scale * global_scale
    inverse = torch.where(dequant > 0, 1.0 / dequant, torch.zeros_like(dequant))
    return to_e2m1(blocks * inverse), dequant


def nvfp4(x: Tensor, global_scale: float, four_over_six: bool = False) -> Tensor:
    """E2M1 values with an E4M3 scale per 16 and a static per-tensor decode scale g (the
    checkpoint's k/v_scale, 1.0 when missing): dequant = code · block scale · g.
    nvfp4_4over6 also tries amax/4 per block and keeps it when its squared reconstruction
    error is strictly smaller (vLLM's SM100 kernel; FlashInfer's writer has no search)."""
    d = x.shape[-1]
    blocks = x.float().unflatten(-1, (d // NVFP4_BLOCK, NVFP4_BLOCK))
    amax = blocks.abs().amax(-1, keepdim=True)
    codes, dequant = _nvfp4_candidate(blocks, amax, global_scale, 6.0)
    if four_over_six:
        codes4, dequant4 = _nvfp4_candidate(blocks, amax, global_scale, 4.0)
        err6 = ((codes * dequant - blocks) ** 2).sum(-1, keepdim=True)
        err4 = ((codes4 * dequant4 - blocks) ** 2).sum(-1, keepdim=True)
        use4 = err4 < err6
        codes, dequant = torch.where(use4, codes4, codes), torch.where(use4, dequant4, dequant)
    return (codes * dequant).flatten(-2)
