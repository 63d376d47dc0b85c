"""`kvcalib estimate`: the KV cache's size in each storage format, and what fits in a budget.

For K and V of every attention layer, M = 2·L·B·T·H_kv·d·b bytes (L layers, B requests of
T tokens, H_kv KV heads of d dims, b bytes per element), counted layer by layer:

- Only attention layers hold KV. Mamba, linear-attention, MLP and other layers keep
  fixed-size state or none, not KV cache: they are listed as excluded, not counted (vLLM
  takes a hybrid model's Mamba state from the same memory, per request).
- A sliding-window layer caches min(T, window) tokens of a request; a full layer T.
- MLA (DeepSeek-V2/V3) caches one latent of kv_lora_rank + qk_rope_head_dim elements per
  token and layer instead of K and V.

Formats:
- 16-bit: vLLM's `auto` cache in the model's dtype (bfloat16 or float16; vLLM serves
  float32 checkpoints in its platform's preferred 16-bit type, bfloat16 on current GPUs
  and CPUs), 2 bytes per element.
- fp8: 1 byte per element, and per latent element for MLA (vLLM's FP8 MLA backends may add
  a few scale bytes per token; not counted). Layers named in --kv-cache-dtype-skip-layers
  stay 16-bit, as vLLM keeps them.
- kivi2, 2-bit KIVI (Liu et al., 2024), per attention layer with C = H_kv·d channels, group
  size G and residual R, for n cached tokens:
  - codes: 2 bits per element, C/4 bytes per token for K and as many for V;
  - keys are quantized per channel in groups of G tokens, each group storing an fp16 scale
    and zero point per channel: 4·C bytes per group;
  - values are quantized per token in groups of G channels within each head, with an fp16
    scale and zero point per group: 4·H_kv·⌈d/G⌉ bytes per token;
  - the R most recent tokens stay in 16 bits; of the older n − R tokens, keys not yet
    filling a group of G stay in 16 bits too (the residual). So keys take
    g·(G·C/4 + 4·C) + (n − g·G)·2C bytes with g = ⌊max(n − R, 0)/G⌋, and values
    (n − min(n, R))·(C/4 + 4·H_kv·⌈d/G⌉) + min(n, R)·2C bytes.
  Its bytes per token is the long-context rate C/2 + 4C/G + 4·H_kv·⌈d/G⌉ per layer. KIVI
  quantizes K and V heads, so it does not apply to MLA's latent (n/a). Skipped layers stay
  16-bit.
- any other vLLM 0.32.0 `--kv-cache-dtype` (kvcalib.kvcache.formats.FORMATS), on request: its page
  bytes per token and layer as the backend's customize_spec counts them (inline scales,
  slots rounded to even bytes), 16-bit for skipped layers and for the boundary layers
  turboquant_* and ultraquant_4bit keep; n/a with the reason where vLLM refuses the model.

With a budget:
- tokens that fit: the budget over the bytes per token with every attention layer full
  (the full-attention view; for models without sliding windows, vLLM's "KV cache size: N
  tokens"), floored to whole blocks of `block_size` tokens, as vLLM allocates them.
  vLLM 0.32.0 on CPU uses 128-token blocks (16 for MLA); its GPU backends default to 16.
- max concurrency: the budget // the bytes of one T-token request (windows applied),
  in whole requests. vLLM rounds each layer's tokens up to whole blocks, so when T is not a
  multiple of the block size it fits slightly fewer. For sliding-window and chunked layers
  its reservation (max_memory_usage_bytes in v1/kv_cache_interface.py, which its "Maximum
  concurrency" uses) is larger still: one block more than a sliding window, plus the
  scheduler's in-flight tokens (max_num_batched_tokens per concurrent batch) per layer.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Any, ClassVar

from kvcalib.checks import Check, CommandResult
from kvcalib.choices import OptionGroup, comma_separated, option
from kvcalib.errors import UsageError
from kvcalib.hub import resolve_config
from kvcalib.kvcache import formats as kv_formats
from kvcalib.kvcache import geometry
from kvcalib.kvcache.summary import estimate_summary
from kvcalib.text import index_ranges

DEFAULT_BLOCK_SIZE = 16  # vLLM's GPU default; its CPU backend uses 128
BYTES_16BIT = 2
SCALE_ZERO_BYTES = 4  # one fp16 scale and one fp16 zero point
# vLLM's max_model_len default: the smallest of these the config has.
MAX_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                   "model_max_length", "max_sequence_length", "max_seq_length", "seq_len")
_UNITS = {"": 2**30, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
NO_LENGTH = f"config.json has no {MAX_LENGTH_KEYS[0]}; pass --context-length"
_BUDGET = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Kivi(OptionGroup):
    """2-bit KIVI's layout (see the module docstring)."""

    group_size: int = option(32, "KIVI group: tokens per key group, channels per value group.",
                             "--kivi-group-size", "--kivi-group", low=1)
    residual: int = option(128, "KIVI: most recent tokens kept in 16 bits.", "--kivi-residual",
                           low=0)


@dataclass(frozen=True)
class EstimateOptions(OptionGroup):
    """What `estimate` sizes: requests of how many tokens, in which formats, and (with a
    budget) what fits in how much memory."""

    context_length: int | None = option(None, "Tokens per request (default: the model's "
                                        "max_position_embeddings).", "--context-length", "-T",
                                        low=1)
    batch: int = option(1, "Requests, for the total.", "--batch", "-B", low=1)
    budget: str | None = option(None, "KV-cache memory: GiB as a plain number, or with a unit "
                                "(16GiB, 512MiB, 80GB). Adds tokens that fit (budget / bytes "
                                "per token with every attention layer full, in whole blocks) "
                                "and max concurrency (budget // bytes of one request of "
                                "--context-length tokens, sliding windows applied).")
    block_size: int = option(DEFAULT_BLOCK_SIZE, "Tokens per KV block for the budget figures: "
                             "vLLM's GPU backends default to 16, its CPU backend uses 128 (16 "
                             "for MLA).", low=1)
    kivi: Kivi = Kivi()
    kv_cache_dtype_skip_layers: list[str] = option(
        [], "Layers vLLM keeps in the model dtype (indices or sliding_window); repeat or use "
        "commas.", callback=comma_separated)
    formats: list[str] = option([], "'all' or kv_cache_dtype names, comma separated, as eval "
                                "--formats takes them (auto is the model dtype; kivi2 too); "
                                "default: the model dtype, fp8 and kivi2.", "--formats", comma=str)


@dataclass
class FormatEstimate:
    """One storage format. None where it does not apply (KIVI on MLA) or without a budget."""

    name: str
    bytes_per_token: float | None  # every attention layer full; KIVI: its long-context rate
    request_bytes: int | None  # one request of context_length tokens
    total_bytes: int | None  # batch requests
    tokens_fit: int | None = None
    max_concurrency: int | None = None
    note: str = ""


@dataclass
class Estimate(CommandResult):
    checks: ClassVar[list[Check]] = []  # checks nothing: exit code 0

    model: str
    model_type: str
    dtype: str  # the 16-bit cache's dtype
    attention: str  # MHA, GQA, MQA or MLA
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mla_latent_dim: int | None
    context_length: int
    context_source: str
    batch: int
    budget_bytes: int | None
    block_size: int
    kivi: Kivi
    attention_layers: list[int]
    sliding_layers: list[dict[str, int]]  # index, window
    excluded_layers: list[dict[str, Any]]  # index, block_type: not KV cache, not counted
    skip_layers: list[int]  # kept 16-bit in the quantized formats
    defaults: list[str]  # KV fields taken from transformers' class defaults
    formats: list[FormatEstimate] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return estimate_summary(self)


def parse_budget(text: str) -> int:
    """Bytes from '16' (GiB), '16GiB', '512MiB', '80GB'..."""
    match = _BUDGET.match(text)
    unit = match[2].lower() if match else None
    if match is None or unit not in _UNITS:
        raise UsageError(f"budget {text!r} is not a size: give GiB as a number (16) or a number "
                         "with a unit (16GiB, 512MiB, 80GB)")
    try:
        value = int(Decimal(match[1]) * _UNITS[unit])
    except InvalidOperation:
        raise UsageError(f"budget {text!r} is not a size") from None
    if value <= 0:
        raise UsageError(f"budget {text!r} is not positive")
    return value


def estimate(model: str, options: EstimateOptions = EstimateOptions()) -> Estimate:
    """Read config.json of a folder, config file or hub id, then `from_config`."""
    return from_config(resolve_config(model), options, source=model)


def from_config(config: dict[str, Any], options: EstimateOptions = EstimateOptions(),
                source: str = "config.json") -> Estimate:
    """KV bytes per format for `batch` requests of `context_length` tokens (default: the
    model's maximum length) and, given a budget, what fits in it. Formats: the model
    dtype, fp8 and kivi2 unless named; any name in kvcalib.kvcache.formats.FORMATS (auto
    is the model dtype), kivi2, or "all"."""
    context_length = options.context_length
    config, shape, defaults = _read_config(config, need_length=context_length is None)
    context_source = "--context-length"
    if context_length is None:
        found = _max_length(config)
        if found is None:
            raise UsageError(NO_LENGTH)
        context_length, context_source = found
    budget_bytes = parse_budget(options.budget) if options.budget is not None else None
    if not shape.attention_layers:
        raise UsageError(f"{source}: no attention layers, so no KV cache ({len(shape.layers)} "
                         f"layers: {', '.join(sorted({x.block_type for x in shape.layers}))})")
    skipped = _skip_layers(options.kv_cache_dtype_skip_layers, shape)
    dtype = geometry.cache_dtype(shape.dtype)
    result = Estimate(
        model=source, model_type=shape.model_type, dtype=dtype, attention=_attention(shape),
        num_layers=shape.num_layers, num_heads=shape.num_heads,
        num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        mla_latent_dim=shape.mla_latent_dim, context_length=context_length,
        context_source=context_source, batch=options.batch, budget_bytes=budget_bytes,
        block_size=options.block_size, kivi=options.kivi, attention_layers=shape.attention_layers,
        sliding_layers=[{"index": layer.index, "window": layer.window} for layer in shape.layers
                        if layer.kind == geometry.SLIDING],
        excluded_layers=[{"index": layer.index, "block_type": layer.block_type}
                         for layer in shape.layers if layer.kind == geometry.NONE],
        skip_layers=sorted(skipped), defaults=defaults)
    names = _format_names(options.formats, dtype)
    result.formats = [_format(name, shape, result, skipped) for name in names]
    return result


def _format_names(formats: list[str], dtype: str) -> list[str]:
    if not formats:
        return [dtype, "fp8", "kivi2"]
    if formats == ["all"]:
        return [dtype, *(name for name in kv_formats.FORMATS if name != "auto"), "kivi2"]
    kv_formats.check_names([name for name in formats if name != dtype], "kivi2")
    return [dtype if name == "auto" else name for name in formats]


def _read_config(config: dict[str, Any], need_length: bool
                 ) -> tuple[dict[str, Any], geometry.Geometry, list[str]]:
    """The geometry; a config missing a field is completed from transformers' defaults."""
    try:
        shape = geometry.geometry(config)
        if not need_length or _max_length(config) is not None:
            return config, shape, []
        problem: UsageError = geometry.MissingField(NO_LENGTH)
    except geometry.MissingField as exc:  # only missing fields; invalid values stay errors
        problem = exc
    full, filled = geometry.complete_config(config)
    if not filled:
        raise problem
    return full, geometry.geometry(full), filled


def _max_length(config: dict[str, Any]) -> tuple[int, str] | None:
    """vLLM's default max_model_len, and where it came from."""
    text = geometry.text_config(config)
    found = {key: geometry.config_int(text, key) for key in MAX_LENGTH_KEYS
             if text.get(key) is not None}
    if not found:
        return None
    key = min(found, key=found.__getitem__)
    return found[key], f"the model's {key}"


def _attention(shape: geometry.Geometry) -> str:
    if shape.mla_latent_dim is not None:
        return "MLA"
    if shape.num_kv_heads == 1:
        return "MQA"
    return "MHA" if shape.num_kv_heads == shape.num_heads else "GQA"


def _skip_layers(items: list[str], shape: geometry.Geometry) -> set[int]:
    """Layer indices vLLM keeps 16-bit: indices, or 'sliding_window' for every sliding layer.
    Not Llama 4's chunked layers: vLLM's Attention matches 'sliding_window' by the layer's
    sliding window, and ChunkedLocalAttention has none."""
    skipped: set[int] = set()
    attention = shape.attention_layers
    for item in (item.strip() for item in items):
        if item == "sliding_window":
            sliding = [layer.index for layer in shape.layers if layer.kind == geometry.SLIDING
                       and layer.block_type != "chunked_attention"]
            if not sliding:
                raise UsageError("skip layer 'sliding_window': the model has no sliding-window "
                                 "layers")
            skipped.update(sliding)
        elif item.isdigit():
            if int(item) not in attention:
                raise UsageError(f"skip layer {item} is not an attention layer (attention "
                                 f"layers: {index_ranges(attention)})")
            skipped.add(int(item))
        elif item:
            raise UsageError(f"unknown skip layer {item!r}: give layer indices or "
                             "sliding_window")
    return skipped


def kivi_layer_bytes(tokens: int, kv_heads: int, head_dim: int, kivi: Kivi) -> int:
    """Bytes of one layer's KIVI-2 cache holding `tokens` tokens (see the module docstring)."""
    channels, group = kv_heads * head_dim, kivi.group_size
    recent = min(tokens, kivi.residual)
    older = tokens - recent
    key_groups = older // group
    codes = math.ceil(channels * 2 / 8)  # bytes of one token's 2-bit codes
    keys = (key_groups * (group * codes + SCALE_ZERO_BYTES * channels)
            + (tokens - key_groups * group) * channels * BYTES_16BIT)
    value_groups = kv_heads * math.ceil(head_dim / group)
    values = (older * (codes + SCALE_ZERO_BYTES * value_groups)
              + recent * channels * BYTES_16BIT)
    return keys + values


def _kivi_rate(shape: geometry.Geometry, kivi: Kivi) -> Fraction:
    channels, group = shape.num_kv_heads * shape.head_dim, kivi.group_size
    codes = math.ceil(channels * 2 / 8)
    return (2 * codes + Fraction(SCALE_ZERO_BYTES * channels, group)
            + SCALE_ZERO_BYTES * shape.num_kv_heads * math.ceil(shape.head_dim / group))


def _format(name: str, shape: geometry.Geometry, result: Estimate,
            skipped: set[int]) -> FormatEstimate:
    elements = shape.elements_per_token_per_layer
    if name == "kivi2" and shape.mla_latent_dim is not None:
        return FormatEstimate(name, None, None, None, note="n/a: KIVI quantizes K and V "
                              "heads; MLA caches a latent")
    vllm = kv_formats.FORMATS.get(name) if name not in (result.dtype, "fp8", "kivi2") else None
    kept: set[int] = set()
    if vllm is not None:
        cache = shape.cache_shape()
        reason = vllm.unsupported(cache)
        if reason:
            return FormatEstimate(name, None, None, None, note=f"n/a: {reason}")
        kept = set(vllm.kept_layers(shape.num_layers, shape.hybrid))
        if not vllm.fp8:  # fp8 aliases: 1 byte per element below, as fp8
            quantized_bytes = Fraction(vllm.bytes_per_token(cache))
    full_view = Fraction(0)
    request = 0
    for layer in shape.layers:
        if layer.kind == geometry.NONE:
            continue
        tokens = min(result.context_length, layer.window or result.context_length)
        if name == result.dtype or layer.index in skipped | kept:
            full_view += elements * BYTES_16BIT
            request += tokens * elements * BYTES_16BIT
        elif name == "fp8" or (vllm is not None and vllm.fp8):
            full_view += elements
            request += tokens * elements
        elif vllm is not None:
            full_view += quantized_bytes
            request += tokens * quantized_bytes
        else:
            full_view += _kivi_rate(shape, result.kivi)
            request += kivi_layer_bytes(tokens, shape.num_kv_heads, shape.head_dim, result.kivi)
    notes = {"fp8": "1 byte per latent element" if shape.mla_latent_dim else "",
             "kivi2": f"2-bit, groups of {result.kivi.group_size}, last "
                      f"{result.kivi.residual} tokens 16-bit; bytes/token at long context"}
    note = notes.get(name, "")
    if kept:
        note = (f"keeps layers {index_ranges(sorted(kept))} in {result.dtype} (vLLM's "
                "boundary layers)")
    estimate = FormatEstimate(name, float(full_view), int(request), int(request) * result.batch,
                              note=note)
    if result.budget_bytes is not None:
        blocks = math.floor(result.budget_bytes / (result.block_size * full_view))
        estimate.tokens_fit = blocks * result.block_size
        estimate.max_concurrency = result.budget_bytes // int(request)
    return estimate
