"""Where a checkpoint's KV scales will not serve as they are, on engines other than the one
verify runs, read in their own sources: the vLLM 0.33.0 and SGLang 0.5.23 wheels.

So far the per-head (attn_head) rule, which decides whether a release starts at all; the
full table of serving targets (GPU classes, ROCm, MLA, q_scale, NVFP4) is issue 34's.
"""

from __future__ import annotations

from kvcalib.checks import WARN, Check

# vllm/model_executor/layers/attention/attention.py (Attention.__init__) asks for per-head
# scales when kv_cache_scheme.strategy == "attn_head"; AttentionBackend.
# validate_configuration (vllm/v1/attention/backend.py) rejects every backend whose
# supports_per_head_quant_scales() is False, which is all but FlashAttention at version
# >= 3 (backends/flash_attn.py); get_flash_attn_version (backends/fa_utils.py) picks FA3
# on SM 9.x, FA4 on SM 10.0, FA2 elsewhere and none on ROCm.
ATTN_HEAD_VLLM = (
    "vLLM 0.33 starts them only where its FlashAttention backend runs version 3 or later, "
    "which it picks on Hopper (SM 9.x; FA4 on SM 10.0): on Ampere, Ada, consumer "
    "Blackwell and ROCm the server does not start (\"per-head quant scales not supported\", "
    "vllm/v1/attention/backend.py, validate_configuration)")
# sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py:
# CompressedTensorsConfig.get_quant_method and CompressedTensorsKVCacheMethod.
# is_supported_scheme (strategy must be "tensor").
ATTN_HEAD_SGLANG = (
    "SGLang 0.5.23 ignores the scheme and serves without these scales, logging \"Ignoring "
    "compressed-tensors kv_cache_scheme ...: only static symmetric per-tensor FP8 scales are "
    "supported.\" (srt/layers/quantization/compressed_tensors/compressed_tensors.py)")


def serving_notes(strategy: str | None) -> list[Check]:
    """Warnings for a scheme that some engines refuse or drop, with the portable fix."""
    if strategy != "attn_head":
        return []
    return [Check("serving", WARN, f"attn_head scales: {ATTN_HEAD_VLLM}; {ATTN_HEAD_SGLANG}. "
                  "For those fleets, `kvcalib convert CKPT --strategy tensor --output DIR` "
                  "writes the per-tensor copy (each layer's largest head)")]
