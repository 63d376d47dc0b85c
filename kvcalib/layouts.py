"""Where each checkpoint format declares its KV-cache scheme and keeps its scale tensors.

The formats vLLM loads FP8 KV scales from:
- compressed-tensors (llm-compressor): `quantization_config.kv_cache_scheme`, tensors
  `...self_attn.k_scale` / `.v_scale` / `.q_scale`;
- `quant_method: fp8`: per-tensor `...self_attn.k_scale` (or `k_proj.k_scale`);
- ModelOpt: `kv_cache_quant_algo: FP8`, tensors `...k_proj.k_scale` / `v_proj.v_scale`;
- Quark: `kv_cache_group`, tensors `...k_proj.output_scale` / `v_proj.output_scale`.
Names follow vLLM's remapping (model_loader/weight_utils.py, maybe_remap_kv_scale_name).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcalib.checkpoint import CheckpointError, TensorInfo, read_json

# module path with a layer number and an attention module, then the scale
_ATTN = r"(?P<module>(?:.*\.)?(?P<layer>\d+)\.[^.]*att[^.]*)"
SCALE_PATTERNS = [
    re.compile(_ATTN + r"\.(?P<kind>[kvq])_scale$"),  # compressed-tensors, fp8
    re.compile(_ATTN + r"\.(?P<proj>[kvq])_proj\.(?P<kind>[kvq])_scale$"),  # ModelOpt, fp8
    re.compile(_ATTN + r"\.(?P<kind>[kvq])_proj\.output_scale$"),  # Quark
    re.compile(_ATTN + r"\.(?P<kind>kv)_scale$"),  # deprecated: one scale for k and v
]


class UnsupportedFormat(Exception):
    """A quantization format kvcalib does not know how vLLM loads KV scales from."""


@dataclass
class KvScheme:
    """The KV-cache quantization a checkpoint declares, as vLLM would read it."""

    layout: str
    strategy: str = "tensor"
    quantizes_query: bool = False
    declared: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ScaleTensor:
    layer: int
    kind: str  # "k", "v" or "q" ("kv": one tensor for both)
    info: TensorInfo


def kv_scheme(folder: Path, config: dict[str, Any]) -> KvScheme | None:
    """The declared scheme, None when the checkpoint declares no KV quantization."""
    quant = config.get("quantization_config")
    if not quant and (Path(folder) / "hf_quant_config.json").exists():
        legacy = read_json(folder, "hf_quant_config.json", what="ModelOpt config")
        section = legacy.get("quantization") if isinstance(legacy, dict) else None
        quant = {"quant_method": "modelopt", **_object(section, "hf_quant_config.json: "
                                                        "quantization")}
    if not quant:
        return None
    quant = _object(quant, "config.json: quantization_config")
    method = str(quant.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(quant)
    if method == "fp8":
        return KvScheme("fp8", declared={"quant_method": "fp8"})
    if method.startswith("modelopt"):
        algo = quant.get("kv_cache_quant_algo")
        if not algo:
            return None
        scheme = KvScheme("modelopt", declared={"kv_cache_quant_algo": algo})
        if str(algo).upper() != "FP8":
            scheme.problems.append(f"kv_cache_quant_algo is {algo}; vLLM loads FP8 scales only")
        return scheme
    if method == "quark":
        return KvScheme("quark", declared={"kv_cache_group": quant.get("kv_cache_group")}) if (
            quant.get("kv_cache_group")) else None
    raise UnsupportedFormat(f"quant_method {quant.get('quant_method')!r}")


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CheckpointError(f"{where} must be a JSON object")
    return value


def _compressed_tensors(quant: dict[str, Any]) -> KvScheme | None:
    args = quant.get("kv_cache_scheme")
    if not args:
        return None
    args = _object(args, "quantization_config.kv_cache_scheme")
    scheme = KvScheme("compressed-tensors", strategy=str(args.get("strategy")), declared=args)
    expected = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False}
    for key, want in expected.items():
        if args.get(key) != want:
            scheme.problems.append(f"kv_cache_scheme.{key} is {args.get(key)!r}; vLLM needs "
                                   f"{want!r}")
    if scheme.strategy not in ("tensor", "attn_head"):
        scheme.problems.append(f"kv_cache_scheme.strategy is {scheme.strategy!r}; vLLM needs "
                               "'tensor' or 'attn_head'")
    groups = _object(quant.get("config_groups") or {}, "quantization_config.config_groups")
    for name, group in groups.items():
        group = _object(group, f"quantization_config.config_groups.{name}")
        targets = group.get("targets") or []
        if group.get("input_activations") and not group.get("weights") and isinstance(
                targets, list) and targets and all(
                isinstance(t, str) and ("Attention" in t or "attn" in t) for t in targets):
            scheme.quantizes_query = True
    return scheme


def find_scales(tensors: dict[str, TensorInfo]) -> tuple[list[ScaleTensor], list[str]]:
    """KV scale tensors by layer and kind, and the names found twice for one layer/kind."""
    found: dict[tuple[int, str], ScaleTensor] = {}
    duplicates = []
    for name, info in tensors.items():
        for pattern in SCALE_PATTERNS:
            match = pattern.match(name)
            if match and match.groupdict().get("proj", match["kind"]) == match["kind"]:
                key = (int(match["layer"]), match["kind"])
                if key in found:
                    duplicates.append(name)
                found[key] = ScaleTensor(key[0], key[1], info)
                break
    return sorted(found.values(), key=lambda s: (s.layer, s.kind)), duplicates
