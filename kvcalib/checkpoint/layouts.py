"""Where each checkpoint format declares its KV-cache scheme and keeps its scale tensors,
and what vLLM 0.32's loader for that format needs before it loads them.

The formats vLLM loads FP8 KV scales from:
- compressed-tensors (llm-compressor): `quantization_config.kv_cache_scheme`, tensors
  `...self_attn.k_scale` / `.v_scale` / `.q_scale`;
- `quant_method: fp8`: per-tensor `...self_attn.k_scale` (or `k_proj.k_scale`);
- ModelOpt: `quantization_config {quant_method: modelopt, quant_algo, kv_cache_scheme}` in
  config.json (ModelOpt >= 0.31), or `{quantization: {quant_algo, kv_cache_quant_algo}}`
  in the legacy hf_quant_config.json; tensors `...k_proj.k_scale` / `v_proj.v_scale`;
- Quark: `quantization_config.export.kv_cache_group`, whose patterns must match entries
  of `layer_quant_config` carrying the KV `output_tensors`; tensors
  `...k_proj.output_scale` / `v_proj.output_scale`.
Names follow vLLM's remapping (model_loader/weight_utils.py, maybe_remap_kv_scale_name).
A `problem` is something that makes vLLM refuse the checkpoint, or load it without these
scales: static verify fails on it, because the engine would.

Each format is one ScaleLayout subclass in LAYOUTS that knows how to detect it, name its
scale tensors and write its KV-only config; kv_scheme, find_scales, `convert` and the
checkpoint writers use only the registry, so a new layout is one new class.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvcalib.checkpoint.safetensors import TensorInfo
from kvcalib.dtypes import PLAIN_FLOATS
from kvcalib.errors import CheckpointError
from kvcalib.reads import read_json

# module path with a layer number and an attention module, then the scale
_ATTN = r"(?P<module>(?:.*\.)?(?P<layer>\d+)\.[^.]*att[^.]*)"
# deprecated, in no format kvcalib writes: one scale for k and v
_KV_SCALE = re.compile(_ATTN + r"\.(?P<kind>kv)_scale$")
# vLLM 0.32 (layers/quantization/modelopt.py): the ModelOpt algorithms it has a config for.
MODELOPT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4", "W4A16_NVFP4",
                  "MXFP8", "MIXED_PRECISION")
# Those it accepts from a legacy hf_quant_config.json (transformers_utils/
# model_arch_config_convertor.py); with no quant_algo it loads the model unquantized.
MODELOPT_LEGACY_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "NVFP4")
MODELOPT_LEGACY_FILE = "hf_quant_config.json"
# What vLLM loads from compressed-tensors' kv_cache_scheme (CompressedTensorsConfig).
FP8_KV_SCHEME = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False}
# Tensor name endings that only quantized weights have, in any of these formats.
QUANTIZED_WEIGHT_SUFFIXES = (".weight_scale", ".weight_packed", ".weight_scale_2",
                             ".weight_zero_point", ".weight_global_scale", ".qweight")
# Quark's FP8 KV output_tensors, and a layer it leaves unquantized.
QUARK_FP8_KV = {"dtype": "fp8_e4m3", "qscheme": "per_tensor", "is_dynamic": False,
                "symmetric": True, "ch_axis": None, "group_size": None,
                "round_method": "half_even", "scale_type": "float",
                "observer_cls": "PerTensorMinMaxObserver"}
QUARK_NO_QUANTIZATION = {"weight": None, "input_tensors": None, "output_tensors": None,
                         "bias": None, "target_device": None}


class UnsupportedFormat(Exception):
    """A quantization format kvcalib does not know how vLLM loads KV scales from."""


@dataclass
class KvScheme:
    """The KV-cache quantization a checkpoint declares, as vLLM would read it.

    `source`: the file it was read from. `fp8`: the declared cache type is FP8 E4M3, the
    only one these scales are for. `pre_rope`: the tool measured keys at k_proj's output,
    before RoPE (Quark's default), so the scale does not bound the cached keys.
    """

    layout: str
    strategy: str = "tensor"
    quantizes_query: bool = False
    declared: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    source: str = "config.json"
    fp8: bool = True
    pre_rope: bool = False

    @property
    def kinds(self) -> tuple[str, ...]:
        """The scales each attention layer carries: k and v, and q where queries are
        quantized too (FP8 attention)."""
        return ("k", "v", "q") if self.quantizes_query else ("k", "v")


@dataclass(frozen=True)
class ScaleTensor:
    layer: int
    kind: str  # "k", "v" or "q" ("kv": one tensor for both)
    info: TensorInfo
    module: str = ""  # the attention module it belongs to, e.g. model.layers.0.self_attn


class ScaleLayout:
    """One format's rules for FP8 KV scales, as vLLM 0.32's loader for it reads them.

    `scale_name` (with {module} and {kind}) names a layer's scale tensor and
    `scale_pattern` finds it; `scale_dtype` is what the format's own tool stores scales in
    ("model": the model's dtype); `per_head`: it keeps attn_head scales; `config_files`:
    where besides config.json it declares its scheme. A layout without a `scale_name` is
    read, never written.
    """

    name: ClassVar[str]
    scale_name: ClassVar[str] = ""
    scale_pattern: ClassVar[re.Pattern[str] | None] = None
    scale_dtype: ClassVar[str] = "model"
    per_head: ClassVar[bool] = False
    config_files: ClassVar[tuple[str, ...]] = ()

    def claims(self, quant: dict[str, Any] | None, folder: Path) -> bool:
        """Whether a checkpoint with this quantization_config is in this format."""
        return _method(quant) == self.name

    def detect(self, quant: dict[str, Any], folder: Path) -> KvScheme | None:
        """The KV scheme `quant` (config.json's quantization_config) declares, if any."""
        raise NotImplementedError

    def scale_shape(self, strategy: str, count: int) -> tuple[int, ...]:
        """The shape of a scale tensor holding `count` values (one, or one per head)."""
        return (count, 1, 1) if strategy == "attn_head" else ()

    def kv_only_config(self, strategy: str, tensors: dict[str, TensorInfo]) -> dict[str, Any]:
        """A quantization_config of this format that quantizes the KV cache and no weight
        of `tensors`, as vLLM 0.32 loads it."""
        raise NotImplementedError

    def without_kv_cache(self, quant: dict[str, Any]) -> dict[str, Any] | None:
        """`quant` declaring no KV-cache quantization; None when nothing else is left."""
        return {k: v for k, v in quant.items() if k != "kv_cache_scheme"}


LAYOUTS: dict[str, ScaleLayout] = {}


def register(cls: type[ScaleLayout]) -> type[ScaleLayout]:
    LAYOUTS[cls.name] = cls()
    return cls


def _method(quant: dict[str, Any] | None) -> str:
    return str(quant.get("quant_method", "")).lower() if quant else ""


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CheckpointError(f"{where} must be a JSON object")
    return value


def kv_cache_args(strategy: str, observer: str):
    """FP8_KV_SCHEME as compressed-tensors' QuantizationArgs: what `run` calibrates and
    `convert` declares."""
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(**FP8_KV_SCHEME, strategy=strategy, observer=observer)


def kv_only_config(kv_args) -> dict[str, Any]:
    """A compressed-tensors quantization_config that quantizes the KV cache as `kv_args`
    (QuantizationArgs) says and no weights, as vLLM 0.32 loads it."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    config = QuantizationConfig(config_groups={}, format="dense",
                                quantization_status=QuantizationStatus.COMPRESSED,
                                kv_cache_scheme=kv_args)
    return {**config.model_dump(mode="json"), "version": compressed_tensors.__version__}


@register
class CompressedTensors(ScaleLayout):
    """llm-compressor's: quantization_config.kv_cache_scheme, `...self_attn.k_scale`."""

    name = "compressed-tensors"
    scale_name = "{module}.{kind}_scale"
    scale_pattern = re.compile(_ATTN + r"\.(?P<kind>[kvq])_scale$")
    per_head = True

    def detect(self, quant: dict[str, Any], folder: Path) -> KvScheme | None:
        args = quant.get("kv_cache_scheme")
        if not args:
            return None
        args = _object(args, "quantization_config.kv_cache_scheme")
        scheme = KvScheme(self.name, strategy=str(args.get("strategy")), declared=args)
        scheme.fp8 = (args.get("type"), args.get("num_bits")) == ("float", 8)
        for key, want in FP8_KV_SCHEME.items():
            if args.get(key) != want:
                scheme.problems.append(f"kv_cache_scheme.{key} is {args.get(key)!r}; vLLM "
                                       f"needs {want!r}")
        if scheme.strategy not in ("tensor", "attn_head"):
            scheme.problems.append(f"kv_cache_scheme.strategy is {scheme.strategy!r}; vLLM "
                                   "needs 'tensor' or 'attn_head'")
        groups = _object(quant.get("config_groups") or {}, "quantization_config.config_groups")
        for group_name, group in groups.items():
            group = _object(group, f"quantization_config.config_groups.{group_name}")
            targets = group.get("targets") or []
            if group.get("input_activations") and not group.get("weights") and isinstance(
                    targets, list) and targets and all(
                    isinstance(t, str) and ("Attention" in t or "attn" in t) for t in targets):
                scheme.quantizes_query = True
        return scheme

    def scale_shape(self, strategy: str, count: int) -> tuple[int, ...]:
        return (count, 1, 1) if strategy == "attn_head" else (1,)

    def kv_only_config(self, strategy: str, tensors: dict[str, TensorInfo]) -> dict[str, Any]:
        # Quark and ModelOpt both keep the running absmax, as static_minmax does.
        return kv_only_config(kv_cache_args(strategy, "static_minmax"))

    def without_kv_cache(self, quant: dict[str, Any]) -> dict[str, Any] | None:
        rest = super().without_kv_cache(quant)
        return rest if rest.get("config_groups") else None


@register
class Fp8(ScaleLayout):
    """vLLM's own `quant_method: fp8`: per-tensor `...k_scale` or `k_proj.k_scale`, found by
    the compressed-tensors and ModelOpt patterns; read only."""

    name = "fp8"

    def detect(self, quant: dict[str, Any], folder: Path) -> KvScheme | None:
        return KvScheme(self.name, declared={"quant_method": "fp8"})


@register
class ModelOpt(ScaleLayout):
    """NVIDIA ModelOpt's: quant_algo and kv_cache_scheme in config.json (>= 0.31) or the
    legacy hf_quant_config.json; `...k_proj.k_scale`, stored in float32."""

    name = "modelopt"
    scale_name = "{module}.{kind}_proj.{kind}_scale"
    scale_pattern = re.compile(_ATTN + r"\.(?P<proj>[kvq])_proj\.(?P<kind>[kvq])_scale$")
    scale_dtype = "F32"
    config_files = (MODELOPT_LEGACY_FILE,)

    def claims(self, quant: dict[str, Any] | None, folder: Path) -> bool:
        return _method(quant).startswith("modelopt") or (
            not quant and (Path(folder) / MODELOPT_LEGACY_FILE).exists())

    def detect(self, quant: dict[str, Any], folder: Path) -> KvScheme | None:
        """config.json's quantization_config, flat (ModelOpt >= 0.31: quant_algo and a
        kv_cache_scheme dict) or nesting the legacy {quantization: {...}}, as vLLM reads
        both (ModelOptQuantConfigBase.from_config); with none, hf_quant_config.json."""
        if not quant:
            return self._legacy(read_json(folder, MODELOPT_LEGACY_FILE, what="ModelOpt config"))
        if "quantization" in quant:
            section = _object(quant["quantization"],
                              "config.json: quantization_config.quantization")
            return self._algos(section, "config.json")
        kv = quant.get("kv_cache_scheme")
        if not kv:
            return self._algos(quant, "config.json")
        kv = _object(kv, "quantization_config.kv_cache_scheme")
        scheme = KvScheme(self.name, declared={"quant_algo": quant.get("quant_algo"),
                                               "kv_cache_scheme": kv})
        scheme.fp8 = (kv.get("type"), kv.get("num_bits")) == ("float", 8)
        if not scheme.fp8:
            scheme.problems.append(f"kv_cache_scheme is {kv.get('num_bits')}-bit "
                                   f"{kv.get('type')}; vLLM loads FP8 (8-bit float) scales "
                                   "only")
        scheme.problems += _modelopt_algo_problems(quant.get("quant_algo"), "config.json: "
                                                   "quantization_config", MODELOPT_ALGOS)
        return scheme

    def _legacy(self, legacy: Any) -> KvScheme | None:
        """hf_quant_config.json, which vLLM reads only when config.json has no
        quantization_config, and only from producer modelopt with a known quant_algo."""
        legacy = _object(legacy, MODELOPT_LEGACY_FILE)
        section = _object(legacy.get("quantization"), f"{MODELOPT_LEGACY_FILE}: quantization")
        scheme = self._algos(section, MODELOPT_LEGACY_FILE)
        if scheme is None:
            return None
        producer = legacy.get("producer")
        name = producer.get("name") if isinstance(producer, dict) else None
        if name != "modelopt" and "modelopt_quant_config" not in section:
            scheme.problems.append(f"{MODELOPT_LEGACY_FILE} names no producer 'modelopt' (it "
                                   f"has {name!r}); vLLM then does not read it and loads the "
                                   "model unquantized, without the KV scales")
        elif not scheme.problems:
            scheme.problems += _modelopt_algo_problems(
                section.get("quant_algo"), MODELOPT_LEGACY_FILE, MODELOPT_LEGACY_ALGOS)
        return scheme

    def _algos(self, section: dict[str, Any], source: str) -> KvScheme | None:
        algo = section.get("kv_cache_quant_algo")
        if not algo:
            return None
        scheme = KvScheme(self.name, source=source, declared={
            "quant_algo": section.get("quant_algo"), "kv_cache_quant_algo": algo})
        scheme.fp8 = str(algo).upper() == "FP8"
        if not scheme.fp8:
            scheme.problems.append(f"kv_cache_quant_algo is {algo}; vLLM loads FP8 scales only")
        if source == "config.json":
            scheme.problems += _modelopt_algo_problems(section.get("quant_algo"), source,
                                                       MODELOPT_ALGOS)
        return scheme

    def kv_only_config(self, strategy: str, tensors: dict[str, TensorInfo]) -> dict[str, Any]:
        # vLLM refuses a ModelOpt config without quant_algo (ModelOpt's own KV-only export):
        # FP8 with every module excluded is its way to say "weights not quantized".
        return {"quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["*"],
                "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"}}


def _modelopt_algo_problems(algo: Any, where: str, known: tuple[str, ...]) -> list[str]:
    if not algo and where == MODELOPT_LEGACY_FILE:
        return [f"{where} has no quant_algo: vLLM 0.32 then loads the model unquantized and "
                "ignores the KV scales"]
    if not algo:
        return [f"{where} has no quant_algo: vLLM 0.32 refuses the checkpoint (\"Missing "
                "'quant_algo' in quantization config\"); ModelOpt leaves it out when it "
                "quantizes only the KV cache"]
    if str(algo).upper() not in known:
        return [f"{where}: quant_algo {algo!r} is not one vLLM 0.32 loads ({', '.join(known)})"]
    return []


@register
class Quark(ScaleLayout):
    """AMD Quark's: export.kv_cache_group matching layer_quant_config entries with KV
    output_tensors; `...k_proj.output_scale`."""

    name = "quark"
    scale_name = "{module}.{kind}_proj.output_scale"
    scale_pattern = re.compile(_ATTN + r"\.(?P<kind>[kvq])_proj\.output_scale$")

    def detect(self, quant: dict[str, Any], folder: Path) -> KvScheme | None:
        """Quark's export section and layer_quant_config, checked as vLLM's
        QuarkConfig.from_config and QuarkKVCacheMethod read them."""
        export = quant.get("export")
        if not isinstance(export, dict):
            return KvScheme(self.name, declared={"export": export}, problems=[
                "quantization_config has no export section; vLLM refuses a Quark checkpoint "
                "without one (\"The export key should be included in the configurations of "
                "Quark quantized model\")"])
        group = export.get("kv_cache_group")
        if not group:
            if quant.get("kv_cache_group"):
                scheme = KvScheme(self.name, declared={"kv_cache_group": quant["kv_cache_group"]})
                scheme.problems.append("kv_cache_group is at the top of quantization_config; "
                                       "vLLM reads it only under quantization_config.export, "
                                       "so it loads no KV scales")
                return scheme
            return None
        if not (isinstance(group, list) and all(isinstance(p, str) for p in group)):
            raise CheckpointError("quantization_config.export.kv_cache_group must be a list of "
                                  "names")
        layers = _object(quant.get("layer_quant_config") or {}, "quantization_config."
                         "layer_quant_config")
        matched = [cfg for name, cfg in layers.items()
                   if any(fnmatch.fnmatchcase(name, pattern) for pattern in group)]
        fallback = _object(quant.get("kv_cache_quant_config") or {},
                           "quantization_config.kv_cache_quant_config")
        shown = matched or [cfg for name, cfg in fallback.items()
                            if any(fnmatch.fnmatchcase(name, pattern) for pattern in group)]
        output = shown[0].get("output_tensors") if shown and isinstance(shown[0], dict) else None
        post_rope = quant.get("kv_cache_post_rope", False)
        scheme = KvScheme(self.name, declared={"kv_cache_group": group,
                                               "output_tensors": output,
                                               "kv_cache_post_rope": post_rope},
                          pre_rope=not post_rope,
                          fp8=isinstance(output, dict) and output.get("dtype") == "fp8_e4m3")
        if not matched:
            where = (" (Quark 0.13 writes it under kv_cache_quant_config when it quantizes "
                     "only the KV cache, and vLLM 0.32 does not read that)" if shown else "")
            scheme.problems.append(f"no layer_quant_config entry matches kv_cache_group "
                                   f"{group}{where}: vLLM refuses to load it (\"kv_cache_group "
                                   "parameter setting, but no kv_cache quantization settings "
                                   "were found\")")
            return scheme
        if any(not isinstance(cfg, dict) or cfg.get("output_tensors") != output
               for cfg in matched):
            scheme.problems.append(f"the layer_quant_config entries of kv_cache_group {group} "
                                   "have different output_tensors; vLLM refuses that")
        elif not isinstance(output, dict):
            scheme.problems.append("the KV layers' output_tensors are empty; vLLM refuses that")
        elif (output.get("dtype"), output.get("qscheme")) != ("fp8_e4m3", "per_tensor"):
            scheme.problems.append(f"the KV output_tensors are {output.get('dtype')} "
                                   f"{output.get('qscheme')}; vLLM loads fp8_e4m3 per_tensor "
                                   "only")
        return scheme

    def kv_only_config(self, strategy: str, tensors: dict[str, TensorInfo]) -> dict[str, Any]:
        # vLLM needs the KV output_tensors in layer_quant_config, and every linear layer
        # excluded (it has no scheme for unquantized ones); the scales were taken after RoPE.
        linear = sorted({name.removesuffix(".weight") for name, info in tensors.items()
                         if name.endswith(".weight") and len(info.shape) == 2} | {"lm_head"})
        kv_layer = {**QUARK_NO_QUANTIZATION, "output_tensors": QUARK_FP8_KV}
        return {"quant_method": "quark", "global_quant_config": QUARK_NO_QUANTIZATION,
                "layer_quant_config": {"*k_proj": kv_layer, "*v_proj": kv_layer},
                "layer_type_quant_config": {}, "exclude": linear, "algo_config": None,
                "softmax_quant_spec": None, "quant_mode": "eager_mode",
                "kv_cache_post_rope": True,
                "export": {"kv_cache_group": ["*k_proj", "*v_proj"], "min_kv_scale": 0.0,
                           "pack_method": "reorder", "weight_format": "real_quantized",
                           "weight_merge_groups": None}}


# The layouts `convert` reads and writes.
TARGETS = tuple(name for name, layout in LAYOUTS.items() if layout.scale_name)
SCALE_PATTERNS = [layout.scale_pattern for layout in LAYOUTS.values()
                  if layout.scale_pattern] + [_KV_SCALE]


def layout_of(quant: dict[str, Any] | None, folder: Path) -> ScaleLayout | None:
    """The registered layout of a checkpoint with this quantization_config, if any."""
    return next((layout for layout in LAYOUTS.values() if layout.claims(quant, folder)), None)


def kv_scheme(folder: Path, config: dict[str, Any]) -> KvScheme | None:
    """The declared scheme, None when the checkpoint declares no KV quantization."""
    quant = config.get("quantization_config")
    if quant:
        quant = _object(quant, "config.json: quantization_config")
    layout = layout_of(quant, folder)
    if layout is not None:
        return layout.detect(quant or {}, folder)
    if not quant:
        return None
    raise UnsupportedFormat(f"quant_method {quant.get('quant_method')!r}")


def without_kv_cache(quant: dict[str, Any], folder: Path) -> dict[str, Any] | None:
    """`quant` without its kv_cache_scheme, in its layout's way."""
    layout = layout_of(quant, folder) or ScaleLayout()
    return layout.without_kv_cache(quant)


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
                found[key] = ScaleTensor(key[0], key[1], info, match["module"])
                break
    return sorted(found.values(), key=lambda s: (s.layer, s.kind)), duplicates


def quantized_weights(tensors: dict[str, TensorInfo]) -> list[str]:
    """Tensors that only a weight-quantized checkpoint has (scales, packed or integer
    weights): a checkpoint without any has its weights in a plain float dtype."""
    return [name for name, info in tensors.items()
            if name.endswith(QUANTIZED_WEIGHT_SUFFIXES)
            or (name.endswith(".weight") and info.dtype not in PLAIN_FLOATS)]
