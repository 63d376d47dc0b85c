"""The llm-compressor pass: the modifier, kvcalib's own hooks on the same points its
observers use, and the attention and stopping rules the calibration runs under (see
kvcalib.calibrate.run for why each is chosen).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from kvcalib.calibrate import weight_schemes
from kvcalib.calibrate.options import ScaleOptions
from kvcalib.checkpoint import layouts
from kvcalib.errors import CheckFailed, UsageError
from kvcalib.kvcache import geometry


def attention_modules(model, config: dict[str, Any]) -> dict[str, Any]:
    """Attention modules compressed-tensors can hook, by module name."""
    from compressed_tensors.quantization import is_cached_attention_module

    found = {name: m for name, m in model.named_modules() if is_cached_attention_module(m)}
    if not found:
        raise UsageError(f"{geometry.architecture(config)} has no attention layers "
                         "llm-compressor can hook (it looks for attention modules that take "
                         "past_key_values); kvcalib cannot calibrate its KV cache")
    return found


def attention_classes(attention: dict[str, Any]) -> list[str]:
    return sorted({type(m).__name__ for m in attention.values()})


def build_modifier(scales: ScaleOptions, attention_targets: list[str] | None):
    """The llm-compressor modifier; with attention classes it also calibrates q_scale, and
    with a preset `scheme` it quantizes the weights of every Linear layer but lm_head."""
    from compressed_tensors.quantization import QuantizationScheme
    from llmcompressor.modifiers.quantization import QuantizationModifier

    args = layouts.kv_cache_args(scales.strategy, scales.observer)
    groups = weight_schemes.preset_groups(scales.scheme) if scales.scheme else {}
    if attention_targets:
        groups["attention"] = QuantizationScheme(targets=attention_targets,
                                                 input_activations=args)
    return QuantizationModifier(ignore=weight_schemes.IGNORE, kv_cache_scheme=args,
                                config_groups=groups or None)


def recipe_yaml(modifier) -> str:
    from llmcompressor.recipe import Recipe

    return Recipe.from_modifiers([modifier]).yaml()


class AbsmaxRecorder:
    """Each sample's per-head absmax of the post-RoPE states llm-compressor's observers see
    (batch size 1: one hook call per sample, layer and kind).

    Values go into one array per layer and kind, made at the first sample: thousands of
    small tensors kept alive between the forward passes' large ones would fragment the
    heap and grow the process by megabytes per sample.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self.values: dict[tuple[str, str], np.ndarray] = {}
        self.seen: dict[tuple[str, str], int] = {}

    def hook(self, name: str, kind: str) -> Callable:
        key = (name, kind)

        def record(_module, states):  # states: (1, heads, seq, head_dim)
            amax = states.detach().abs().amax(dim=(0, 2, 3)).float().cpu().numpy()
            if key not in self.values:
                self.values[key] = np.zeros((self.count, amax.size), dtype=np.float32)
            sample = self.seen.get(key, 0)
            if sample < self.count:
                self.values[key][sample] = amax
            self.seen[key] = sample + 1

        return record

    def per_sample(self) -> dict[tuple[str, str], np.ndarray]:
        """(samples, heads) per (module, kind), in the order the samples were fed."""
        for (name, kind), seen in self.seen.items():
            if seen != self.count:
                raise CheckFailed(f"{name}: kvcalib's {kind} hook saw {seen} samples, "
                                  f"expected {self.count}; nothing was saved")
        return self.values


class _StopForward(Exception):
    """Raised once the last attention layer has run: nothing after it changes a scale."""


@contextlib.contextmanager
def stop_after(model, last: Any) -> Iterator[None]:
    """Make every forward pass of `model` end once module `last` has run: the last MLP,
    the final norm and lm_head never run (the basic pipeline ignores the outputs)."""
    def stop(_module, _args, _output):
        raise _StopForward

    forward = model.forward

    @functools.wraps(forward)
    def until_last_attention(*args, **kwargs):
        with contextlib.suppress(_StopForward):
            return forward(*args, **kwargs)

    handle = last.register_forward_hook(stop)
    model.forward = until_last_attention
    try:
        yield
    finally:
        handle.remove()
        del model.forward


def run_oneshot(model, tokenizer, modifier, token_ids: list[list[int]], pipeline: str,
                attention: dict[str, Any], q_scale: bool,
                whole_model: bool = False) -> AbsmaxRecorder:
    """Calibrate on `token_ids`, one sample per batch, in the order given. `whole_model`:
    every layer must see the samples (static activation scales of a weight scheme)."""
    from compressed_tensors.modeling import (
        KV_CACHE_ATTR,
        initialize_hooked_attention,
        initialize_hooked_kv_cache,
    )
    from llmcompressor import oneshot
    from llmcompressor.modifiers.utils.hooks import HooksMixin
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    give_llama4_experts_their_config(model)
    recorder = AbsmaxRecorder(len(token_ids))
    # Registered like llm-compressor's own hooks, so that the sequential pipeline's second
    # pass over each layer (which only propagates outputs) does not record again.
    hooks = HooksMixin()
    for name, module in attention.items():
        # The same hook points llm-compressor attaches its observers to (idempotent).
        if q_scale:
            initialize_hooked_attention(model, module)
            hooks.register_hook(module, recorder.hook(name, "q"), "query")
        initialize_hooked_kv_cache(model, module)
        answer_seq_length(getattr(module, KV_CACHE_ATTR))
        hooks.register_hook(module, recorder.hook(name, "k"), "key")
        hooks.register_hook(module, recorder.hook(name, "v"), "value")
    # Our own loader keeps the samples in the seeded order (llm-compressor would sort
    # them by length), so that sample numbers mean the same everywhere.
    batches = DataLoader([{"input_ids": ids, "attention_mask": [1] * len(ids)}
                          for ids in token_ids], batch_size=1, collate_fn=default_data_collator)
    last = max(attention.items(), key=lambda item: layer_index(item[0]))[1]
    # Without q, the last layer's keys and values are all that is needed of it: stop once
    # its cache has seen them, before its attention and output projection.
    stop_at = last if q_scale else getattr(last, KV_CACHE_ATTR)
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(calibration_attention(model, attention, q_scale))
            if pipeline == "basic" and not whole_model:
                stack.enter_context(stop_after(model, stop_at))
            oneshot(model=model, processor=tokenizer, dataset=batches, recipe=[modifier],
                    pipeline=pipeline)
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        raise CheckFailed(f"calibration failed in llm-compressor: {type(exc).__name__}: "
                          f"{exc}") from exc
    finally:
        hooks.remove_hooks()
    return recorder


def give_llama4_experts_their_config(model) -> None:
    """llm-compressor 0.14.0.1 linearizes MoE experts before it calibrates, and its Llama 4
    converter (llmcompressor/modeling/moe/llama4.py, from_experts_module) reads
    `config.text_config`, which only the multimodal Llama4Config has: a text-only
    Llama4ForCausalLM fails with AttributeError. Its experts get the config it looks for
    (the converter only reads the expert count and sizes from it)."""
    if hasattr(model.config, "text_config"):
        return
    for module in model.modules():
        if type(module).__name__ == "Llama4TextExperts":
            module.config = types.SimpleNamespace(text_config=model.config)


def answer_seq_length(wrapper) -> None:
    """compressed-tensors 0.19 puts its QuantizedKVCache in place of `past_key_values` even
    when there is no cache (compressed_tensors/modeling/kvcache.py,
    _kv_cache_attention_hook), and it has no get_seq_length of its own: Llama 4's NoPE
    layers call it (attention temperature tuning) and fail with AttributeError. It answers
    for the cache it wraps, or 0: calibration samples start at position 0."""
    def get_seq_length(layer_idx: int = 0) -> int:
        wrapped = wrapper.__dict__.get("past_key_values")
        cache = wrapped() if wrapped is not None else None
        return cache.get_seq_length(layer_idx) if cache is not None else 0

    wrapper.get_seq_length = get_seq_length


@contextlib.contextmanager
def calibration_attention(model, attention: dict[str, Any], q_scale: bool,
                          ) -> Iterator[None]:
    """Calibrate under the attention `model` was loaded with (see kvcalib.calibrate.run).

    llm-compressor forces eager attention while calibrating. Under eager without q_scale
    that changes nothing, and is left alone. Otherwise it is turned off: sdpa stays sdpa,
    and with q_scale compressed-tensors' hooked attention stays in place (it observes the
    queries), given the model's own eager function under the name it looks up.
    """
    import llmcompressor.utils.helpers as helpers
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if model.config._attn_implementation == "eager" and not q_scale:
        yield
        return
    module = sys.modules[type(next(iter(attention.values()))).__module__]
    forced_eager = helpers.use_eager_attention
    had_eager = "eager" in ALL_ATTENTION_FUNCTIONS
    previous = ALL_ATTENTION_FUNCTIONS["eager"] if had_eager else None
    helpers.use_eager_attention = lambda model: contextlib.nullcontext()
    ALL_ATTENTION_FUNCTIONS["eager"] = module.eager_attention_forward
    try:
        yield
    finally:
        helpers.use_eager_attention = forced_eager
        if had_eager:
            ALL_ATTENTION_FUNCTIONS["eager"] = previous
        else:
            del ALL_ATTENTION_FUNCTIONS["eager"]


def layer_index(module_name: str) -> int:
    layer = geometry.layer_number(module_name)
    if layer is None:
        raise UsageError(f"cannot tell the layer number of attention module {module_name}")
    return layer


def scale_tensors(attention: dict[str, Any], kinds: tuple[str, ...], dtype: str) -> dict[str, Any]:
    """The scales as they will be saved: in the checkpoint's dtype, named by module."""
    import torch

    scales = {}
    for name, module in attention.items():
        for kind in kinds:
            scale = getattr(module, f"{kind}_scale", None)
            if scale is None:
                raise CheckFailed(f"{name}: llm-compressor produced no {kind}_scale")
            scales[f"{name}.{kind}_scale"] = scale.detach().cpu().to(getattr(torch, dtype))
    return scales


def quantization_config(model, compressed: bool = False) -> dict[str, Any]:
    """The quantization_config llm-compressor itself would write for this model; dense
    unless its weights were quantized here (`compressed`)."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    config = QuantizationConfig.from_pretrained(model)
    if not compressed:
        config.format = "dense"
    config.quantization_status = QuantizationStatus.COMPRESSED
    result = config.model_dump(mode="json")
    result["version"] = compressed_tensors.__version__
    return result


