"""Every dtype kvcalib meets, in one table: safetensors' names and widths, and the names
numpy, torch and config.json use for them. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

E4M3_MAX = 448.0  # the largest finite FP8 E4M3 value: a static scale is absmax / E4M3_MAX
E5M2_MAX = 57344.0


@dataclass(frozen=True)
class DType:
    """One safetensors dtype. `torch` names the plain floating ones weights are stored in
    (also config.json's torch_dtype); `rtol` is the relative step of a value stored in it,
    how far two readings of one stored scale may differ."""

    name: str
    bits: int
    numpy: str | None = None  # little-endian numpy type, where numpy has one
    torch: str | None = None
    rtol: float = 1e-6


# safetensors 0.8's Dtype enum.
DTYPES = {d.name: d for d in (
    DType("BOOL", 8, "?"), DType("U8", 8, "u1"), DType("I8", 8, "i1"),
    DType("I16", 16, "<i2"), DType("U16", 16), DType("I32", 32, "<i4"), DType("U32", 32),
    DType("I64", 64, "<i8"), DType("U64", 64), DType("C64", 64),
    DType("F4", 4), DType("F6_E2M3", 6), DType("F6_E3M2", 6), DType("F8_E5M2", 8),
    DType("F8_E4M3", 8), DType("F8_E8M0", 8), DType("F8_E4M3FNUZ", 8), DType("F8_E5M2FNUZ", 8),
    DType("F16", 16, "<f2", "float16", 2.0**-11), DType("BF16", 16, None, "bfloat16", 2.0**-8),
    DType("F32", 32, "<f4", "float32"), DType("F64", 64, "<f8", "float64"),
)}
BY_TORCH_NAME = {d.torch: d for d in DTYPES.values() if d.torch}
PLAIN_FLOATS = frozenset(BY_TORCH_NAME[name].name for name in BY_TORCH_NAME)
# OCP FP8 formats kvcalib decodes: exponent and mantissa bits.
FP8_BITS = {"F8_E4M3": (4, 3), "F8_E5M2": (5, 2)}
FLOATS = PLAIN_FLOATS | FP8_BITS.keys()


def element_bytes(torch_name: str) -> int:
    """Bytes per element of a floating dtype named as torch names it ('bfloat16')."""
    return BY_TORCH_NAME[torch_name].bits // 8
