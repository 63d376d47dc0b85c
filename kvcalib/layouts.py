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

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcalib.checkpoint import TensorInfo

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
    modelopt_file = Path(folder) / "hf_quant_config.json"
    if not quant and modelopt_file.exists():
        quant = {"quant_method": "modelopt", **json.loads(modelopt_file.read_text()).get(
            "quantization", {})}
    if not quant:
        return None
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


def _compressed_tensors(quant: dict[str, Any]) -> KvScheme | None:
    args = quant.get("kv_cache_scheme")
    if not args:
        return None
    scheme = KvScheme("compressed-tensors", strategy=str(args.get("strategy")), declared=args)
    expected = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False}
    for key, want in expected.items():
        if args.get(key) != want:
            scheme.problems.append(f"kv_cache_scheme.{key} is {args.get(key)!r}; vLLM needs "
                                   f"{want!r}")
    if scheme.strategy not in ("tensor", "attn_head"):
        scheme.problems.append(f"kv_cache_scheme.strategy is {scheme.strategy!r}; vLLM needs "
                               "'tensor' or 'attn_head'")
    for group in (quant.get("config_groups") or {}).values():
        targets = group.get("targets") or []
        if group.get("input_activations") and not group.get("weights") and targets and all(
                "Attention" in t or "attn" in t for t in targets):
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
