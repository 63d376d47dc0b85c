"""Will the model fit? Choose the pipeline, or refuse, before anything is loaded.

Estimated from the safetensors headers and config.json alone:
- weights: every floating tensor in the compute dtype;
- activations of one sample in one layer: eager attention holds heads × S² scores in
  the compute dtype and their float32 softmax, plus the causal mask; the MLP and norms
  a few float32 copies of the hidden and intermediate states;
- the sequential pipeline's cache: each sample's hidden states and mask between layers,
  kept in host memory;
- the runtime: libraries loaded later and allocator slack, a fixed 512 MiB.

`basic` needs the weights and one sample's activations on the device. `sequential`
onloads one layer at a time: the device holds the largest layer and the activations,
host memory the weights and the cache. On a CPU the device is host memory, so
sequential never needs less there. Ranks on one node share its host memory equally.

KVCALIB_DEVICE_MEMORY (GiB, or with a unit: 512MiB, 8GiB...) caps what kvcalib believes
the device has free: to leave room for other jobs, and to test these decisions.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass

from kvcalib.checkpoint.read import Checkpoint
from kvcalib.dtypes import DTYPES, element_bytes
from kvcalib.errors import UsageError
from kvcalib.kvcache import geometry
from kvcalib.kvcache.capacity import parse_budget
from kvcalib.text import size

DEVICE_MEMORY_ENV = "KVCALIB_DEVICE_MEMORY"
FIT = 0.8  # use at most this share of what is free: the activations are estimates
# Floating tensors are cast when loaded, and quantized weights (I8, FP8) decompressed to
# the compute dtype (kvcalib.calibrate.weight_schemes).
CAST_WHEN_LOADED = ("F32", "F16", "BF16", "I8", "F8_E4M3")
PACKED_PER_INT32 = 8  # pack-quantized int4 weights; counts 8-bit packing twice
RUNTIME = 512 * 2**20  # libraries still to load and allocator slack, beyond the estimate


@dataclass(frozen=True)
class Need:
    """Bytes one rank needs, from the headers and config (see the module docstring)."""

    weights: int
    largest_layer: int
    activations: int
    cache: int

    def basic(self) -> int:
        return self.weights + self.activations + RUNTIME


def need(model: Checkpoint, compute_dtype: str, max_seq_len: int, samples: int) -> Need:
    """What one rank needs for `samples` samples of up to `max_seq_len` tokens."""
    element = element_bytes(compute_dtype)
    per_layer: dict[int, int] = defaultdict(int)
    weights = 0
    for name, info in model.tensors.items():
        stored = info.end - info.start
        if name.endswith(".weight_packed"):
            stored = stored // 4 * PACKED_PER_INT32 * element
        elif info.dtype in CAST_WHEN_LOADED:
            stored = stored // (DTYPES[info.dtype].bits // 8) * element
        weights += stored
        layer = geometry.layer_number(name)
        if layer is not None:
            per_layer[layer] += stored
    cfg = geometry.text_config(model.config)
    hidden = int(cfg.get("hidden_size") or 0)
    heads = int(cfg.get("num_attention_heads") or 0)
    intermediate = int(cfg.get("intermediate_size") or 4 * hidden)
    seq = max_seq_len
    activations = (heads * seq**2 * (2 * element + 4) + seq**2 * element
                   + seq * (6 * hidden + 3 * intermediate) * 4)
    cache = samples * (seq * hidden + seq**2) * element
    return Need(weights, max(per_layer.values(), default=weights), activations, cache)


@dataclass(frozen=True)
class Free:
    """Bytes free for this rank: on the device, and in host memory."""

    device: int
    host: int
    capped: bool = False


def available(device: str, local_ranks: int) -> Free:
    """What is free for this rank now. KVCALIB_DEVICE_MEMORY, when lower, stands for what
    the device has; host memory is shared by the ranks of the node."""
    cap_text = os.environ.get(DEVICE_MEMORY_ENV)
    cap = parse_budget(cap_text) if cap_text else None
    host = _host_available()
    if device == "cpu":
        capped = cap is not None and cap < host
        share = (cap if capped else host) // local_ranks
        return Free(share, share, capped)
    import torch

    free = torch.cuda.mem_get_info(torch.device(device))[0]
    capped = cap is not None and cap < free
    return Free(cap if capped else free, host // local_ranks, capped)


def _host_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise UsageError("cannot read MemAvailable from /proc/meminfo")


@dataclass(frozen=True)
class Plan:
    """The pipeline to run on `device`, why, and the bytes behind the choice."""

    pipeline: str
    reason: str
    device: str
    need: Need
    free: Free
    needed: int  # on the device, for the chosen pipeline


def plan(requested: str, need: Need, free: Free, device: str) -> Plan:
    """Choose the pipeline (`auto`: basic when it fits the device, else sequential), or
    refuse with the bytes needed and available when the model cannot fit."""
    device_name = "host memory" if device == "cpu" else f"{device} memory"
    # (bytes needed, bytes free, where) for each pipeline
    if device == "cpu":  # the weights stay in host memory in either pipeline
        sequential = [(need.basic() + need.cache, free.device, device_name)]
    else:
        sequential = [(need.largest_layer + need.activations + RUNTIME, free.device, device_name),
                      (need.weights + need.cache + RUNTIME, free.host, "host memory")]
    requirements = {"basic": [(need.basic(), free.device, device_name)],
                    "sequential": sequential}
    candidates = ["basic", "sequential"] if requested == "auto" else [requested]
    for pipeline in candidates:
        if all(wanted <= FIT * have for wanted, have, _ in requirements[pipeline]):
            needed = requirements[pipeline][0][0]
            if requested != "auto":
                reason = "requested"
            elif pipeline == "basic":
                reason = f"fits: needs ~{size(needed)} of {_free(free, device_name)}"
            else:
                reason = (f"the model needs ~{size(need.basic())} but {device_name} has "
                          f"{_free(free, device_name)}: onloading one layer at a time "
                          f"(~{size(needed)} there)")
            return Plan(pipeline, reason, device, need, free, needed)
    problems = []
    for pipeline in candidates:
        wanted, have, where = next(r for r in requirements[pipeline] if r[0] > FIT * r[1])
        problems.append(f"{pipeline} needs ~{size(wanted)} ({wanted:,} bytes) of {where}, "
                        f"which has {size(have)} ({have:,} bytes) free")
    cap = f" (capped by {DEVICE_MEMORY_ENV})" if free.capped else ""
    raise UsageError(
        f"the model does not fit: {'; '.join(problems)}{cap}. The need counts weights of "
        f"{size(need.weights)}, ~{size(need.activations)} of activations for one sample and "
        f"{size(RUNTIME)} for the runtime; kvcalib uses at most {FIT:.0%} of what is free. "
        "Nothing was loaded")


def _free(free: Free, where: str) -> str:
    capped = f" (capped by {DEVICE_MEMORY_ENV})" if free.capped else ""
    return f"{size(free.device)} free {where}{capped}"
