"""`kvcalib verify`: prove a checkpoint's FP8 KV scales are present, sane and used by vLLM.

Two parts:
- static: what opening the checkpoint checked (kvcalib.checkpoint.read): config.json and
  safetensors headers; only the scale tensors are read, never the weights, and nothing
  is written to the checkpoint folder;
- engine: vLLM starts on the checkpoint in the serving environment (verify.engine), its
  log is checked, and every attention layer's loaded scales are read back and compared
  with the checkpoint. The read-back is what proves use: vLLM's compressed-tensors path
  starts scales at 1.0 and never warns when the tensors are missing.

Exit code: 1 when any check failed, else 2 when a check could not run (no vLLM, a
machine that cannot run an FP8 KV cache), else 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvcalib.checkpoint.read import Checkpoint, Scale, open_checkpoint, short
from kvcalib.checks import ERROR, FAIL, PASS, SKIP, WARN, Check, CommandResult
from kvcalib.data import corpus
from kvcalib.engine import targets as serving
from kvcalib.engine.compare import compare_runs
from kvcalib.engine.interpreter import resolve_vllm_python
from kvcalib.engine.log import HARDWARE
from kvcalib.engine.process import ProbeRequest, ProbeRun, log_folder, run_probe
from kvcalib.errors import UsageError
from kvcalib.kvcache import geometry
from kvcalib.text import Log, stderr
from kvcalib.verify.options import EngineOptions
from kvcalib.verify.summary import verify_summary

COMPARE_PROMPTS = 4
COMPARE_PROMPT_CHARS = 1500


@dataclass
class VerifyResult(CommandResult):
    suite = "kvcalib.verify"

    checkpoint: str
    checks: list[Check] = field(default_factory=list)
    scheme: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    traits: serving.Traits | None = None
    serving: list[serving.Verdict] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "exit_code": self.exit_code,
                "passed": self.exit_code == 0, "scheme": self.scheme, "engine": self.engine,
                "traits": asdict(self.traits) if self.traits else None,
                "serving": [asdict(v) for v in self.serving],
                "checks": [asdict(c) for c in self.checks]}

    def summary(self) -> str:
        return verify_summary(self)


def verify(folder: str | Path, *, static_only: bool = False,
           options: EngineOptions = EngineOptions(), targets: Sequence[str] | None = None,
           log_dir: Path | None = None, log: Log = stderr) -> VerifyResult:
    """Static checks, where it serves (gating the named `targets`: see
    kvcalib.engine.targets), then (unless static_only) the engine check in the serving env."""
    folder = Path(folder)
    chosen = serving.targets(targets)
    ckpt, checks = open_checkpoint(folder)
    result = VerifyResult(str(folder.resolve()), checks,
                          scheme=asdict(ckpt.scheme) if ckpt.scheme else {},
                          traits=serving.checkpoint_traits(ckpt))
    if result.traits is not None:
        result.serving = serving.where_it_serves(result.traits, chosen)
        checks += serving.serving_checks(result.serving, gate=bool(targets))
    if static_only:
        checks.append(Check("engine", SKIP, "--static-only: vLLM was not started"))
        return result
    try:
        python, source = resolve_vllm_python(options.vllm_python)
    except UsageError as exc:
        checks.append(Check("engine", ERROR, str(exc)))
        return result
    log_dir = Path(log_dir) if log_dir else log_folder("verify", folder)
    kv_cache_dtype = options.kv_cache_dtype
    runs = [(kv_cache_dtype, kv_cache_dtype)]
    if options.compare_auto:
        baseline = geometry.cache_dtype(ckpt.geometry and ckpt.geometry.dtype)
        runs.append((f"auto ({baseline})", baseline))
    result.engine = {"python": python, "python_source": source, "runs": {}}
    probes = {}
    for label, dtype in runs:
        log_path = log_dir / f"vllm-{dtype}.log"
        log(f"Starting vLLM with kv_cache_dtype={dtype} ({python}); log: {log_path}")
        ask = ProbeRequest(folder, dtype, options.max_model_len,
                           options.kv_cache_dtype_skip_layers or [],
                           compare_prompts() if options.compare_auto else [])
        probes[label] = run_probe(python, ask, log_path, options.timeout)
        result.engine["runs"][label] = _run_summary(probes[label])
    checks += _engine_checks(probes[kv_cache_dtype], ckpt)
    if options.compare_auto:
        comparison = compare_runs(*probes.values())
        result.engine["compare_auto"] = comparison
        checks += _compare_checks(comparison)
    return result


def compare_prompts() -> list[str]:
    """A few passages of the built-in corpus, long enough for prompt log-probs to mean much."""
    return [doc["text"][:COMPARE_PROMPT_CHARS] for doc in corpus.documents()[:COMPARE_PROMPTS]]


def _run_summary(run: ProbeRun) -> dict[str, Any]:
    facts = run.facts
    return {"kv_cache_dtype": run.kv_cache_dtype, "started": run.started,
            "error": run.result.get("error"), "root_cause": facts.root_cause,
            "timed_out": run.timed_out, "vllm_version": run.result.get("vllm_version"),
            "platform": run.result.get("platform"), "seconds": run.seconds,
            "log": str(run.log_path), "capacity": facts.capacity,
            "scale_one_warnings": facts.scale_one_warnings, "not_loaded": facts.not_loaded,
            "error_lines": facts.errors[:20], "shutdown_error_lines": facts.shutdown_errors[:20],
            "scales": run.result.get("scales")}


def _engine_checks(run: ProbeRun, ckpt: Checkpoint) -> list[Check]:
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
        checks += _readback_checks(run, ckpt)
    if facts.shutdown_errors:
        checks.append(Check("note", WARN, f"after answering, vLLM's shutdown printed "
                            f"{len(facts.shutdown_errors)} error lines (kept in {run.log_path}; "
                            f"they say nothing about the checkpoint), first: "
                            f"{facts.shutdown_errors[0]}", value=facts.shutdown_errors[:20]))
    return checks


def _start_check(run: ProbeRun) -> Check:
    """Whether vLLM started and answered, and if not, why: the root cause in full."""
    facts, error = run.facts, run.result.get("error") or ""
    if run.started and not error:
        return Check("engine", PASS, f"vLLM {run.result.get('vllm_version')} started in "
                     f"{run.result.get('start_seconds')}s with "
                     f"kv_cache_dtype={run.kv_cache_dtype}")
    if facts.hardware and not run.started:
        hint = (" Verify on the serving hardware, or pass --kv-cache-dtype bfloat16 to check "
                "here that the scales load (FP8 storage is then not exercised)."
                if HARDWARE.search(facts.hardware) else
                " Verify on the serving hardware.")
        said = f"\nvLLM: {facts.root_cause}" if facts.root_cause else ""
        return Check("engine", ERROR, f"cannot check on this machine: {facts.hardware}.{hint}"
                     f"{said}", value={"reason": facts.hardware, "root_cause": facts.root_cause})
    if error.startswith("cannot import vllm") or run.timed_out:
        return Check("engine", ERROR, f"cannot check: {error}", value=error)
    cause = facts.root_cause or error
    what = "vLLM started, but the probe failed" if run.started else "vLLM failed to start"
    return Check("engine", FAIL, f"{what}: {cause}", value={"error": error, "root_cause": cause})


def _readback_checks(run: ProbeRun, ckpt: Checkpoint) -> list[Check]:
    """Every attention layer's loaded scales must equal the checkpoint's values."""
    scheme, shape = ckpt.scheme, ckpt.geometry
    fp8_cache = run.kv_cache_dtype.startswith("fp8")
    if scheme is not None and scheme.layout != "compressed-tensors" and not fp8_cache:
        return [Check("readback", ERROR, f"not proven: vLLM loads {scheme.layout} KV scales "
                      f"only into an FP8 cache, so with kv_cache_dtype={run.kv_cache_dtype} "
                      "there was nothing to read back. Proven here: vLLM starts on the "
                      "checkpoint (the log check says what it printed). Verify with "
                      "--kv-cache-dtype fp8 on hardware that supports it.")]
    loaded = {geometry.layer_number(name): entry
              for name, entry in (run.result.get("scales") or {}).items()}
    checks = []
    for layer in shape.attention_layers if shape else sorted(k for k in loaded if k is not None):
        entry = loaded.get(layer)
        if entry is None:
            checks.append(Check("readback", FAIL, f"vLLM has no attention layer {layer}",
                                layer=layer))
            continue
        for kind in ckpt.kinds:
            checks.append(_compare_scale(layer, kind, entry, ckpt.scales.get(layer, kind)))
    return checks


def _compare_scale(layer: int, kind: str, entry: dict[str, Any], stored: Scale | None) -> Check:
    got = np.asarray(entry.get(kind, []), dtype=np.float64)
    if stored is None:
        return Check("readback", FAIL, f"layer {layer}: vLLM runs with {kind}_scale "
                     f"{got.tolist()}, and the checkpoint has no valid {kind}_scale to load",
                     layer, value=got.tolist())
    want = stored.values
    if kind == "q" and want.size > got.size > 0:
        # vLLM keeps one q scale per KV head: the largest of each group of query heads.
        want = want.reshape(got.size, -1).max(axis=1)
    rtol = stored.rtol
    as_float = entry.get(f"{kind}_float")
    same = got.shape == want.shape and np.allclose(got, want, rtol=rtol, atol=0)
    if same and as_float is not None:
        same = math.isclose(as_float, float(want.max()), rel_tol=rtol)
    if not same:
        return Check("readback", FAIL, f"layer {layer}: vLLM loaded {kind}_scale {got.tolist()} "
                     f"(backends use {as_float}), the checkpoint has {want.tolist()}", layer,
                     value={"engine": got.tolist(), "checkpoint": want.tolist()})
    return Check("readback", PASS, f"layer {layer} {kind}_scale loaded as {short(got.tolist())}",
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
