"""`kvcalib verify`: prove a checkpoint's FP8 KV scales are present, sane and used by vLLM.

Two parts:
- static: config.json and safetensors headers; only the scale tensors are read, never
  the weights, and nothing is written to the checkpoint folder;
- engine: vLLM starts on the checkpoint in the serving environment (kvcalib.engine), its
  log is checked, and every attention layer's loaded scales are read back and compared
  with the checkpoint. The read-back is what proves use: vLLM's compressed-tensors path
  starts scales at 1.0 and never warns when the tensors are missing.

Exit code: 1 when any check failed, else 2 when a check could not run (no vLLM, a
machine that cannot run an FP8 KV cache), else 0.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvcalib import checkpoint, corpus, engine, geometry, layouts
from kvcalib.checks import ERROR, FAIL, PASS, SKIP, WARN, Check, exit_code
from kvcalib.errors import KvcalibError, UsageError
from kvcalib.kvformats import E4M3_MAX
from kvcalib.report import index_ranges

# A scale times 448 is the largest |K|, |V| or |Q| it represents. Real activations stay
# far inside these bounds; values outside are uninitialized memory or a unit mix-up.
MIN_PLAUSIBLE_ABSMAX = 1e-6
MAX_PLAUSIBLE_ABSMAX = 1e6
SMALLEST_NORMAL_FP32 = 2.0**-126  # smaller non-zero values are denormals (1e-39 and such)


@dataclass
class VerifyResult:
    checkpoint: str
    checks: list[Check] = field(default_factory=list)
    scheme: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        return exit_code(self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "exit_code": self.exit_code,
                "passed": self.exit_code == 0, "scheme": self.scheme, "engine": self.engine,
                "checks": [asdict(c) for c in self.checks]}


@dataclass
class StaticScales:
    """What the static check read: the scheme, the model shape and every scale's values."""

    scheme: layouts.KvScheme | None
    geometry: geometry.Geometry | None
    values: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)
    dtypes: dict[tuple[int, str], str] = field(default_factory=dict)


def static_checks(folder: Path) -> tuple[list[Check], StaticScales]:
    """Everything that can be checked without an engine. Reads headers and scales only."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UsageError(f"checkpoint folder not found: {folder}")
    checks: list[Check] = []
    found = StaticScales(None, None)
    try:
        config = checkpoint.load_config(folder)
        found.geometry = geometry.geometry(config)
    except KvcalibError as exc:
        return [Check("config", FAIL, str(exc))], found
    try:
        found.scheme = layouts.kv_scheme(folder, config)
    except layouts.UnsupportedFormat as exc:
        return [Check("scheme", FAIL, f"unsupported checkpoint format: {exc}; kvcalib "
                      "cannot tell whether vLLM loads KV scales from it")], found
    except KvcalibError as exc:
        return [Check("scheme", FAIL, str(exc))], found
    checks.append(_scheme_check(found.scheme))
    try:
        tensors = checkpoint.tensor_index(folder)
    except KvcalibError as exc:
        checks.append(Check("weights", FAIL, str(exc)))
        return checks, found
    checks.append(Check("weights", PASS, f"{len(tensors)} tensors in "
                        f"{len({t.file for t in tensors.values()})} safetensors files"))
    layer_check = _layers_check(found.geometry, tensors)
    checks.append(layer_check)
    if layer_check.status != PASS:
        return checks, found
    scales, duplicates = layouts.find_scales(tensors)
    checks += [Check("scales", FAIL, f"{name}: a second scale for the same layer and kind",
                     tensor=name) for name in duplicates]
    if found.scheme is not None:
        checks += scale_checks(scales, found)
        checks += measurement_notes(found)
    return checks, found


def measurement_notes(found: StaticScales) -> list[Check]:
    """Where a tool measured the scales, when it is not what the cache stores (warnings:
    vLLM loads them all the same)."""
    notes = []
    if found.scheme is not None and found.scheme.pre_rope:
        notes.append(Check("measurement", WARN, "keys were measured at k_proj's output, "
                           "before RoPE (Quark's default, kv_cache_post_rope false): the k "
                           "scale does not bound the post-RoPE keys the cache stores, which "
                           "can be larger; calibrate after RoPE (kvcalib run, or Quark's "
                           "kv_cache_post_rope)"))
    pairs = [(found.values[(layer, "k")], found.values.get((layer, "v")))
             for layer, kind in found.values if kind == "k"]
    merged = len(pairs) > 1 and all(v is not None and np.array_equal(k, v) for k, v in pairs)
    if merged and found.scheme is not None and found.scheme.layout == "quark":
        notes.append(Check("measurement", WARN, f"k_scale equals v_scale in all {len(pairs)} "
                           "layers: Quark merged k and v into one scale, max(k, v) (it does so "
                           "for its kv_cache_group before RoPE), which is coarser than needed "
                           "for the smaller of the two"))
    return notes


def _layers_check(shape: geometry.Geometry, tensors: dict[str, checkpoint.TensorInfo]) -> Check:
    """The config's attention layers must exist, and the weights must hold each of them: a
    gate that checked no layer must not pass, and a config claiming more layers than the
    files hold is a finding, not a loop over them."""
    attention = shape.attention_layers
    if not attention:
        kinds = ", ".join(sorted({layer.block_type for layer in shape.layers})) or "none"
        return Check("layers", FAIL, f"config.json declares no attention layers "
                     f"({shape.num_layers} layers: {kinds}): there is no KV cache to check")
    held = {geometry.layer_number(name) for name in tensors} - {None}
    missing = sorted(set(attention) - held)
    if missing:
        return Check("layers", FAIL, f"config.json declares {shape.num_layers} layers, but the "
                     f"weights hold no tensor of attention layers {index_ranges(missing)}",
                     value=len(missing))
    return Check("layers", PASS, f"{len(attention)} attention layers of {shape.num_layers}")


def _scheme_check(scheme: layouts.KvScheme | None) -> Check:
    if scheme is None:
        return Check("scheme", FAIL, "the checkpoint declares no KV-cache quantization "
                     "(no kv_cache_scheme): vLLM would store an FP8 cache with scale 1.0")
    if scheme.problems:
        return Check("scheme", FAIL, "; ".join(scheme.problems), value=scheme.declared)
    query = ", with q_scale" if scheme.quantizes_query else ""
    return Check("scheme", PASS, f"{scheme.layout} FP8 KV cache, strategy "
                 f"{scheme.strategy}{query}", value=scheme.declared)


def _expected_kinds(scheme: layouts.KvScheme) -> tuple[str, ...]:
    return ("k", "v", "q") if scheme.quantizes_query else ("k", "v")


def _expected_size(kind: str, scheme: layouts.KvScheme, shape: geometry.Geometry) -> int:
    if scheme.strategy != "attn_head":
        return 1
    return shape.num_heads if kind == "q" else shape.num_kv_heads


def scale_checks(scales: list[layouts.ScaleTensor], found: StaticScales) -> list[Check]:
    scheme, shape = found.scheme, found.geometry
    assert scheme is not None and shape is not None
    by_key: dict[tuple[int, str], layouts.ScaleTensor] = {}
    for scale in scales:
        for kind in (("k", "v") if scale.kind == "kv" else (scale.kind,)):
            by_key[(scale.layer, kind)] = scale
    checks = []
    expected_layers = shape.attention_layers
    for layer in expected_layers:
        for kind in _expected_kinds(scheme):
            scale = by_key.get((layer, kind))
            if scale is None:
                checks.append(Check("scales", FAIL,
                                    f"layer {layer}: no {kind}_scale tensor; vLLM would use 1.0",
                                    layer=layer))
                continue
            check, values = _value_check(layer, kind, scale.info,
                                         _expected_size(kind, scheme, shape))
            checks.append(check)
            if values is not None:
                found.values[(layer, kind)] = values
                found.dtypes[(layer, kind)] = scale.info.dtype
    for (layer, _), scale in sorted(by_key.items()):
        if layer not in expected_layers:
            checks.append(Check("scales", WARN, f"{scale.info.name}: the "
                                f"config has no attention layer {layer}; vLLM ignores it",
                                layer=layer, tensor=scale.info.name))
    k_and_v = [v for (_, kind), v in found.values.items() if kind in ("k", "v")]
    if k_and_v and all(np.all(v == 1.0) for v in k_and_v):
        checks.append(Check("scales", FAIL, "every k_scale and v_scale is exactly 1.0: "
                            "placeholders, not calibrated values"))
    return checks


def _value_check(layer: int, kind: str, info: checkpoint.TensorInfo,
                 size: int) -> tuple[Check, np.ndarray | None]:
    name = "scales"

    def fail(message: str, value: Any = None) -> tuple[Check, None]:
        return Check(name, FAIL, f"{info.name}: {message}", layer, info.name, value), None

    if info.dtype not in checkpoint.FLOAT_DTYPES:
        return fail(f"dtype {info.dtype} is not floating point", info.dtype)
    count = math.prod(info.shape)
    if count != size:
        want = "a single value" if size == 1 else f"{size} values (one per head)"
        return fail(f"shape {list(info.shape)} holds {count} values; the strategy needs {want}",
                    list(info.shape))
    try:
        values = checkpoint.read_tensor(info).astype(np.float64).ravel()
    except KvcalibError as exc:
        return fail(str(exc))
    listed = values.tolist()
    if not np.all(np.isfinite(values)):
        return fail(f"non-finite value {listed}", listed)
    if np.any(values <= 0):
        return fail(f"value {listed} is not positive", listed)
    if np.any(values < SMALLEST_NORMAL_FP32):
        return fail(f"value {listed} is a denormal: uninitialized memory, not a scale", listed)
    absmax = values * E4M3_MAX
    if np.any(absmax < MIN_PLAUSIBLE_ABSMAX) or np.any(absmax > MAX_PLAUSIBLE_ABSMAX):
        return fail(f"value {listed} means |{kind}| up to {absmax.max():.3g}, outside "
                    f"[{MIN_PLAUSIBLE_ABSMAX:g}, {MAX_PLAUSIBLE_ABSMAX:g}] that real "
                    "activations reach: uninitialized memory or wrong units", listed)
    return Check(name, PASS, f"{info.name} = {_short(listed)}", layer, info.name, listed), values


def _short(values: list[float]) -> str:
    return f"{values[0]:.6g}" if len(values) == 1 else (
        f"{min(values):.6g}..{max(values):.6g} ({len(values)} heads)")


# ----- engine ----- #

# Relative tolerance of a scale stored in each dtype, for comparing read-back values.
STORAGE_RTOL = {"BF16": 2.0**-8, "F16": 2.0**-11, "F32": 1e-6, "F64": 1e-6}
COMPARE_PROMPTS = 4


def storage_rtol(dtype: str | None) -> float:
    """How far two readings of a scale stored in `dtype` (safetensors name) may differ."""
    return STORAGE_RTOL.get(dtype or "F32", 1e-6)

COMPARE_PROMPT_CHARS = 1500


def verify(
    folder: str | Path,
    *,
    static_only: bool = False,
    vllm_python: str | None = None,
    kv_cache_dtype: str = "fp8",
    max_model_len: int | None = None,
    skip_layers: list[str] | None = None,
    compare_auto: bool = False,
    log_dir: Path | None = None,
    timeout: float = 1200,
    log: Callable[[str], None] = lambda message: print(message, file=sys.stderr, flush=True),
) -> VerifyResult:
    """Static checks, then (unless static_only) the engine check in the serving env."""
    if not 0 < timeout < math.inf:
        raise UsageError(f"--timeout must be a positive number of seconds, not {timeout:g}")
    folder = Path(folder)
    checks, found = static_checks(folder)
    result = VerifyResult(str(folder.resolve()), checks,
                          scheme=asdict(found.scheme) if found.scheme else {})
    if static_only:
        checks.append(Check("engine", SKIP, "--static-only: vLLM was not started"))
        return result
    try:
        python, source = engine.resolve_vllm_python(vllm_python)
    except UsageError as exc:
        checks.append(Check("engine", ERROR, str(exc)))
        return result
    log_dir = Path(log_dir) if log_dir else Path("kvcalib-verify-logs") / folder.resolve().name
    options = {"max_model_len": max_model_len, "skip_layers": skip_layers, "timeout": timeout,
               "prompts": compare_prompts() if compare_auto else None}
    runs = [(kv_cache_dtype, kv_cache_dtype)]
    if compare_auto:
        baseline = engine.unquantized_cache_dtype(found.geometry and found.geometry.dtype)
        runs.append((f"auto ({baseline})", baseline))
    result.engine = {"python": python, "python_source": source, "runs": {}}
    probes = {}
    for label, dtype in runs:
        log_path = log_dir / f"vllm-{dtype}.log"
        log(f"Starting vLLM with kv_cache_dtype={dtype} ({python}); log: {log_path}")
        probes[label] = engine.run_probe(python, folder, dtype, log_path, **options)
        result.engine["runs"][label] = _run_summary(probes[label])
    checks += _engine_checks(probes[kv_cache_dtype], found)
    if compare_auto:
        comparison = engine.compare_runs(*probes.values())
        result.engine["compare_auto"] = comparison
        checks += _compare_checks(comparison)
    return result


def compare_prompts() -> list[str]:
    """A few passages of the built-in corpus, long enough for prompt log-probs to mean much."""
    return [doc["text"][:COMPARE_PROMPT_CHARS] for doc in corpus.documents()[:COMPARE_PROMPTS]]


def _run_summary(run: engine.ProbeRun) -> dict[str, Any]:
    facts = run.facts
    return {"kv_cache_dtype": run.kv_cache_dtype, "started": run.started,
            "error": run.result.get("error"), "root_cause": facts.root_cause,
            "timed_out": run.timed_out, "vllm_version": run.result.get("vllm_version"),
            "platform": run.result.get("platform"), "seconds": run.seconds,
            "log": str(run.log_path), "capacity": facts.capacity,
            "scale_one_warnings": facts.scale_one_warnings, "not_loaded": facts.not_loaded,
            "error_lines": facts.errors[:20], "shutdown_error_lines": facts.shutdown_errors[:20],
            "scales": run.result.get("scales")}


def _engine_checks(run: engine.ProbeRun, found: StaticScales) -> list[Check]:
    """The start, the log before the probe's answer, capacity and the read-back; what vLLM
    printed while shutting down after the answer is a note."""
    facts = run.facts
    start = _start_check(run)
    checks = [start]
    for line in facts.scale_one_warnings:
        checks.append(Check("log", FAIL, f"vLLM logged: {line}", value=line))
    for line in facts.not_loaded:
        checks.append(Check("log", FAIL, f"vLLM did not load a scale: {line}", value=line))
    if facts.errors:
        # Beside a failed start the error lines are that failure: same status, no repeat.
        status = FAIL if start.status == PASS else start.status
        checks.append(Check("log", status, f"{len(facts.errors)} error lines in the log before "
                            f"the answer, first: {facts.errors[0]}", value=facts.errors[:20]))
    if not any(c.group == "log" for c in checks):
        checks.append(Check("log", PASS, "no scale-1.0 warning, no unloaded scale, no errors"))
    if facts.capacity:
        checks.append(Check("capacity", PASS, f"{facts.capacity['pool']} KV cache: "
                            f"{facts.capacity['tokens']:,} tokens", value=facts.capacity))
    if start.status == PASS:
        checks += _readback_checks(run, found)
    if facts.shutdown_errors:
        checks.append(Check("note", WARN, f"after answering, vLLM's shutdown printed "
                            f"{len(facts.shutdown_errors)} error lines (kept in {run.log_path}; "
                            f"they say nothing about the checkpoint), first: "
                            f"{facts.shutdown_errors[0]}", value=facts.shutdown_errors[:20]))
    return checks


def _start_check(run: engine.ProbeRun) -> Check:
    """Whether vLLM started and answered, and if not, why: the root cause in full."""
    facts, error = run.facts, run.result.get("error") or ""
    if run.started and not error:
        return Check("engine", PASS, f"vLLM {run.result.get('vllm_version')} started in "
                     f"{run.result.get('start_seconds')}s with "
                     f"kv_cache_dtype={run.kv_cache_dtype}")
    if facts.hardware and not run.started:
        hint = (" Verify on the serving hardware, or pass --kv-cache-dtype bfloat16 to check "
                "here that the scales load (FP8 storage is then not exercised)."
                if engine.HARDWARE.search(facts.hardware) else
                " Verify on the serving hardware.")
        said = f"\nvLLM: {facts.root_cause}" if facts.root_cause else ""
        return Check("engine", ERROR, f"cannot check on this machine: {facts.hardware}.{hint}"
                     f"{said}", value={"reason": facts.hardware, "root_cause": facts.root_cause})
    if error.startswith("cannot import vllm") or run.timed_out:
        return Check("engine", ERROR, f"cannot check: {error}", value=error)
    cause = facts.root_cause or error
    what = "vLLM started, but the probe failed" if run.started else "vLLM failed to start"
    return Check("engine", FAIL, f"{what}: {cause}", value={"error": error, "root_cause": cause})


def _readback_checks(run: engine.ProbeRun, found: StaticScales) -> list[Check]:
    """Every attention layer's loaded scales must equal the checkpoint's values."""
    scheme, shape = found.scheme, found.geometry
    fp8_cache = run.kv_cache_dtype.startswith("fp8")
    if scheme is not None and scheme.layout != "compressed-tensors" and not fp8_cache:
        return [Check("readback", ERROR, f"not proven: vLLM loads {scheme.layout} KV scales "
                      f"only into an FP8 cache, so with kv_cache_dtype={run.kv_cache_dtype} "
                      "there was nothing to read back. Proven here: vLLM starts on the "
                      "checkpoint (the log check says what it printed). Verify with "
                      "--kv-cache-dtype fp8 on hardware that supports it.")]
    loaded = {geometry.layer_number(name): entry
              for name, entry in (run.result.get("scales") or {}).items()}
    kinds = _expected_kinds(scheme) if scheme else ("k", "v")
    checks = []
    for layer in shape.attention_layers if shape else sorted(k for k in loaded if k is not None):
        entry = loaded.get(layer)
        if entry is None:
            checks.append(Check("readback", FAIL, f"vLLM has no attention layer {layer}",
                                layer=layer))
            continue
        for kind in kinds:
            checks.append(_compare_scale(layer, kind, entry, found))
    return checks


def _compare_scale(layer: int, kind: str, entry: dict[str, Any], found: StaticScales) -> Check:
    got = np.asarray(entry.get(kind, []), dtype=np.float64)
    stored = found.values.get((layer, kind))
    if stored is None:
        return Check("readback", FAIL, f"layer {layer}: vLLM runs with {kind}_scale "
                     f"{got.tolist()}, and the checkpoint has no valid {kind}_scale to load",
                     layer, value=got.tolist())
    want = stored
    if kind == "q" and stored.size > got.size > 0:
        # vLLM keeps one q scale per KV head: the largest of each group of query heads.
        want = stored.reshape(got.size, -1).max(axis=1)
    rtol = storage_rtol(found.dtypes.get((layer, kind)))
    as_float = entry.get(f"{kind}_float")
    same = got.shape == want.shape and np.allclose(got, want, rtol=rtol, atol=0)
    if same and as_float is not None:
        same = math.isclose(as_float, float(want.max()), rel_tol=rtol)
    if not same:
        return Check("readback", FAIL, f"layer {layer}: vLLM loaded {kind}_scale {got.tolist()} "
                     f"(backends use {as_float}), the checkpoint has {want.tolist()}", layer,
                     value={"engine": got.tolist(), "checkpoint": want.tolist()})
    return Check("readback", PASS, f"layer {layer} {kind}_scale loaded as {_short(got.tolist())}",
                 layer, value=got.tolist())


def _compare_checks(comparison: dict[str, Any]) -> list[Check]:
    checks = []
    capacity = comparison.get("capacity")
    if capacity:
        status = PASS if capacity["ratio"] >= 1.5 else WARN  # FP8 halves the bytes per token
        checks.append(Check("compare", status, f"KV capacity {capacity['fp8_tokens']:,} tokens "
                            f"with {comparison['fp8']} vs {capacity['auto_tokens']:,} with "
                            f"{comparison['auto']}: {capacity['ratio']}x", value=capacity))
    outputs = comparison.get("outputs")
    if outputs:
        checks.append(Check("compare", PASS, f"prompt log-probs over {outputs['positions']} "
                            f"positions: top-1 agreement {outputs['top1_agreement']:.1%}, mean "
                            f"|Δ log-prob| {outputs['mean_abs_logprob_diff']}; greedy outputs "
                            f"identical for {outputs['greedy_identical']} of {outputs['prompts']}",
                            value=outputs))
    else:
        checks.append(Check("compare", SKIP, "outputs not compared: an engine did not start"))
    return checks
