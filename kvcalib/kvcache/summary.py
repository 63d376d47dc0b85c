"""`kvcalib estimate`'s summary: tokens and concurrency per cache format."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcalib.tables import right_aligned, table
from kvcalib.text import count, index_ranges, size

if TYPE_CHECKING:
    from kvcalib.kvcache.capacity import Estimate


def estimate_summary(result: Estimate) -> str:
    """The table and the facts it rests on, for people."""
    heads = (f"latent of {result.mla_latent_dim} dims (MLA, {result.num_heads} query heads)"
             if result.mla_latent_dim is not None else
             f"{result.num_kv_heads} KV heads x {result.head_dim} dims ({result.attention}, "
             f"{result.num_heads} query heads)")
    lines = [f"Model: {result.model} ({result.model_type}, {result.dtype})",
             f"KV cache: {len(result.attention_layers)} attention layers of "
             f"{result.num_layers}, {heads}",
             f"Requests: {result.batch} x {result.context_length:,} tokens "
             f"({result.context_source})"]
    if result.budget_bytes is not None:
        lines.append(f"Budget: {size(result.budget_bytes)} ({result.budget_bytes:,} bytes), "
                     f"blocks of {result.block_size} tokens")
    headers = ["format", "bytes/token", "per request", f"total (x{result.batch})"]
    rows = [[f.name, count(f.bytes_per_token),
             size(f.request_bytes) if f.request_bytes is not None else "n/a",
             size(f.total_bytes) if f.total_bytes is not None else "n/a"]
            for f in result.formats]
    if result.budget_bytes is not None:
        headers += ["tokens that fit", f"max concurrency @ {result.context_length:,}"]
        for row, f in zip(rows, result.formats, strict=True):
            row += [count(f.tokens_fit), count(f.max_concurrency)]
    lines += ["", table(headers, right_aligned(headers, rows)), ""]
    lines += _estimate_notes(result)
    return "\n".join(lines)


def _estimate_notes(result: Estimate) -> list[str]:
    capped = ", sliding-window layers capped at their window" if result.sliding_layers else ""
    notes = [f"- bytes/token: every attention layer full; per request: "
             f"{result.context_length:,} tokens{capped}"]
    if result.budget_bytes is not None:
        notes.append(f"- tokens that fit: budget / bytes per token, in whole blocks of "
                     f"{result.block_size}; max concurrency: budget // per-request bytes")
    notes += [f"- {f.name}: {f.note}" for f in result.formats if f.note]
    windows: dict[int, list[int]] = {}
    for layer in result.sliding_layers:
        windows.setdefault(layer["window"], []).append(layer["index"])
    notes += [f"- sliding window {window:,}: layers {index_ranges(indices)}"
              for window, indices in windows.items()]
    kinds: dict[str, list[int]] = {}
    for layer in result.excluded_layers:
        kinds.setdefault(layer["block_type"], []).append(layer["index"])
    notes += [f"- not KV cache, not counted: {kind} layers {index_ranges(indices)}"
              for kind, indices in kinds.items()]
    if result.skip_layers:
        notes.append(f"- kept {result.dtype} in fp8/kivi2 (--kv-cache-dtype-skip-layers): "
                     f"layers {index_ranges(result.skip_layers)}")
    if result.defaults:
        notes.append("- absent from config.json, taken from transformers' defaults for "
                      f"{result.model_type}: {', '.join(result.defaults)}")
    return notes
