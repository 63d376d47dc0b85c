"""Whether a checkpoint's files hold every weight its architecture needs, and nothing it
does not know.

Neither vLLM 0.32 nor transformers checks this: vLLM starts a checkpoint whose shard is
empty ("Checkpoint size: 0.00 GiB"), and transformers fills missing weights at random, so
a calibration on such a model measures noise. `verify` (a check) and `run` (a refusal
before loading) both ask here.

The expected names come from the model class itself, built on the meta device (no
memory, no weights) where torch and transformers import (the calibration environment).
Elsewhere (the fast tier, a config transformers cannot build) they come from the config:
every declared layer must hold weights. Quantized weights (weight_packed, weight_scale,
input_scale...) and KV scales live under the modules they belong to, so a parameter
counts as present when any tensor stands for it, and a tensor is unexpected only when no
module of the model owns it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvcalib.checkpoint.layouts import find_scales
from kvcalib.errors import KvcalibError
from kvcalib.kvcache import geometry
from kvcalib.text import index_ranges

# At most this many names in one message; the count says how many more.
SHOWN = 8


def _stored_as_itself(name: str) -> str:
    return name


def _none_merged(weights: set[str]) -> list[str]:
    return []


@dataclass(frozen=True)
class Expected:
    """What the architecture needs: parameter names and the modules that may own tensors
    (from the model class), or nothing more than the layers (from the config).

    `loaded_as` maps a stored tensor name to the parameter transformers loads it into: its
    checkpoint conversions rename keys and merge per-expert tensors (Mixtral's
    `block_sparse_moe.experts.0.w1.weight` becomes `mlp.experts.gate_up_proj`).
    `merged_gaps` names the per-expert tensors missing from a merged parameter that has
    some of them (transformers would merge the rest into a parameter of the wrong size).
    """

    source: str  # "the model class X" or "config.json"
    parameters: frozenset[str] = frozenset()
    modules: frozenset[str] = frozenset()
    loaded_as: Callable[[str], str] = _stored_as_itself
    merged_gaps: Callable[[set[str]], list[str]] = _none_merged


@dataclass(frozen=True)
class WeightProblems:
    """Parameters with no tensor, tensors no module owns, and where the names came from."""

    source: str
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected)

    def describe(self) -> str:
        """One line naming the problems (the first SHOWN of each)."""
        parts = []
        for what, names in (("missing", self.missing), ("unexpected", self.unexpected)):
            if names:
                more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
                parts.append(f"{len(names)} {what}: {', '.join(names[:SHOWN])}{more}")
        return f"weights do not match {self.source}: " + "; ".join(parts)


def expected(config: dict[str, Any]) -> Expected:
    """The names the architecture of `config` needs (see the module docstring)."""
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig
    except ImportError:
        return _from_config(config)
    import transformers

    plain = {k: v for k, v in config.items() if k != "quantization_config"}
    named = (config.get("architectures") or [None])[0]
    try:
        # config.json writes Infinity as {"__float__": "Infinity"} (Mamba's time_step_limit)
        built = AutoConfig.for_model(**PreTrainedConfig._decode_special_floats(plain))
        with torch.device("meta"):
            if isinstance(named, str) and hasattr(transformers, named):
                # the class that saved the checkpoint names its tensors
                model = getattr(transformers, named)._from_config(built)
            else:
                model = AutoModelForCausalLM.from_config(built)
    except Exception:  # an architecture transformers cannot build: fall back on the config
        return _from_config(config)
    # remove_duplicate: a tied parameter (lm_head = embed_tokens) is needed once
    parameters = frozenset(name for name, _ in model.named_parameters(remove_duplicate=True))
    modules = frozenset(name for name, _ in model.named_modules(remove_duplicate=False))
    loaded_as, merged_gaps = _conversions(model)
    return Expected(f"the model class {type(model).__name__}", parameters, modules,
                    loaded_as, merged_gaps)


def _conversions(model: Any) -> tuple[Callable[[str], str], Callable[[set[str]], list[str]]]:
    """transformers' own renaming of stored keys at load time
    (core_model_loading.convert_and_load_state_dict_in_model, step 1), and the check that
    every expert of a merged parameter is stored: a MergeModulelist(dim=0) stacks one
    stored tensor per expert along the parameter's first dimension, for each of the
    converter's source patterns (`.experts.*.w1.weight`)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        MergeModulelist,
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    state = model.state_dict()
    stacking = [re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
                for c in converters if any(isinstance(op, MergeModulelist) and op.dim == 0
                                           for op in c.operations)
                for pattern in c.source_patterns if "*" in pattern]

    def loaded_as(name: str) -> str:
        renamed, _ = rename_source_key(name, renamings, converters, model.base_model_prefix,
                                       state)
        return name if renamed not in state and name in state else renamed

    def merged_gaps(weights: set[str]) -> list[str]:
        experts: dict[tuple[str, str], set[int]] = {}  # (parameter, pattern) -> stored
        for name in weights:
            for pattern in stacking:
                found = pattern.search(name)
                if found:
                    key = (loaded_as(name), name[:found.start(1)] + "*" + name[found.end(1):])
                    experts.setdefault(key, set()).add(int(found.group(1)))
        gaps = []
        for (parameter, stored_as), have in sorted(experts.items()):
            if parameter not in state:  # no such parameter: weight_problems calls it unexpected
                continue
            count = state[parameter].shape[0]
            lacking = sorted(set(range(count)) - have)
            if lacking:
                gaps.append(f"{stored_as} for experts {index_ranges(lacking)} of {count}")
        return gaps

    return loaded_as, merged_gaps


def _from_config(config: dict[str, Any]) -> Expected:
    """No model class: the layer check of weight_problems is all that can be said."""
    return Expected("config.json (every declared layer holds weights)")


def weight_problems(tensors: dict[str, Any], config: dict[str, Any]) -> WeightProblems:
    """What the files lack or hold beyond what `config`'s architecture needs.

    Layers first, from the config: a config claiming far more layers than the files hold
    is named as a range, never built as a model or looped over.
    """
    scales = {s.info.name for s in find_scales(tensors)[0]}
    weights = set(tensors) - scales
    missing_layers = _missing_layers(weights, config)
    if missing_layers:
        return WeightProblems("config.json", [f"every weight of layers {missing_layers}"])
    want = expected(config)
    if not want.parameters:
        return WeightProblems(want.source)
    # a quantized weight is stored as weight_packed, weight_scale...: any of them stands
    # for it (by its owner and the parameter's own name)
    loaded = {name: want.loaded_as(name) for name in weights}
    present = set(loaded.values())
    stored = {(t.rsplit(".", 1)[0], t.rsplit(".", 1)[-1].split("_")[0]) for t in present}
    missing = sorted(p for p in want.parameters if p not in present
                     and tuple(p.rsplit(".", 1)) not in stored) + want.merged_gaps(weights)
    unexpected = sorted(name for name, target in loaded.items()
                        if target.rsplit(".", 1)[0] not in want.modules)
    return WeightProblems(want.source, missing, unexpected)


def _missing_layers(weights: set[str], config: dict[str, Any]) -> str:
    """The declared layers that hold no weight, as ranges ('' when none)."""
    try:
        declared = geometry.config_int(geometry.text_config(config), "num_hidden_layers",
                                       "n_layer", "num_layers", required=False) or 0
    except KvcalibError:
        return ""  # the config check names a bad count
    held = {n for n in (geometry.layer_number(name) for name in weights) if n is not None}
    top = max(held, default=-1) + 1
    parts = [index_ranges(sorted(set(range(min(top, declared))) - held))] if top else []
    if declared > top:
        parts.append(f"{top}-{declared - 1}" if declared - 1 > top else str(top))
    return ", ".join(p for p in parts if p)
