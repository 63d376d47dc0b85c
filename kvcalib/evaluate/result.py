"""What `kvcalib eval` returns: metrics per configuration, the probes' results, and the
checks a pipeline gates on: the gates on the checkpoint's own scales (or, comparing
formats, on the recommended format), the sweep and the engine cross-check."""

from __future__ import annotations

from dataclasses import asdict, astuple, dataclass, field
from typing import Any

from kvcalib.checks import ERROR, FAIL, PASS, SKIP, WARN, Check, CommandResult
from kvcalib.evaluate.metrics import Metrics
from kvcalib.evaluate.options import Gates
from kvcalib.evaluate.summary import eval_summary


@dataclass
class EvalResult(CommandResult):
    checkpoint: str
    samples: dict[str, Any]
    reference_ppl: float
    metrics: dict[str, Metrics]
    notes: list[str] = field(default_factory=list)
    verdict: str = ""
    passkey: dict[str, Any] | None = None
    sweep: dict[str, Any] | None = None
    engine: dict[str, Any] | None = None
    kivi: dict[str, Any] | None = None
    formats: dict[str, Any] | None = None  # --formats: rows, recommendation, top two
    # weight-quantized: weights only, KV only, both against the unquantized model
    separate: dict[str, Any] | None = None
    layer_scales: dict[str, Any] = field(default_factory=dict)  # layers, largest k/v scale
    checks: list[Check] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        result = asdict(self)
        result["exit_code"] = self.exit_code
        return result

    def summary(self) -> str:
        return eval_summary(self)


def gate_checks(result: EvalResult, main: str, gates: Gates) -> list[Check]:
    """The notes as warnings, the gates on `main` (the checkpoint's scales), the sweep's skip
    set and the engine cross-check; a skip when no gate is set."""
    checks = [Check("note", WARN, note) for note in result.notes]
    if result.formats is not None:  # the gates choose a format instead
        checks += _recommendation_checks(result.formats, gates, result.passkey is None)
    else:
        checks += _main_gates(result, main, gates)
    if result.sweep and "recommendation" in result.sweep:
        rec = result.sweep["recommendation"]
        checks.append(Check("sweep", PASS if rec["met"] else WARN,
                            f"skip set for KL <= {rec['max_kl']}: {rec['flag']} (KL "
                            f"{rec['kl']:.5f})", value=rec))
    if result.engine is not None:
        if "error" in result.engine:
            checks.append(Check("engine", ERROR, f"engine cross-check: {result.engine['error']}"))
        else:
            out = result.engine["outputs"]
            checks.append(Check("engine", PASS, f"vLLM fp8 vs model dtype: perplexity "
                                f"{out['ppl_fp8']:.4g} vs {out['ppl_auto']:.4g}, top-1 agreement "
                                f"{out['top1_agreement']:.1%}"))
        if "separate" in result.engine:
            checks.append(_engine_apart_check(result.engine["separate"]))
    if not any(c.group == "gate" for c in checks):
        checks.append(Check("gate", SKIP, "no gate set (--max-kl, --max-ppl-increase, "
                            "--min-passkey)"))
    return checks


def _engine_apart_check(apart: dict[str, Any]) -> Check:
    """The weights-only, KV-only and combined rows in vLLM: each row's perplexity change
    against the unquantized model, or why a row could not run."""
    if "error" in apart:
        return Check("engine", ERROR, f"vLLM weights and KV apart: {apart['error']}")
    failed = [f"{name}: {row['error']}" for name, row in apart["rows"].items() if "error" in row]
    if failed:
        return Check("engine", ERROR, f"vLLM weights and KV apart: {'; '.join(failed)}")
    changes = ", ".join(f"{name.split(' (')[0]} {row['ppl_change']:+.2%}"
                        for name, row in apart["rows"].items())
    return Check("engine", PASS, f"vLLM perplexity change against the unquantized model: "
                 f"{changes}")


def _main_gates(result: EvalResult, main: str, gates: Gates) -> list[Check]:
    """The gates on the checkpoint's own scales (or scale 1.0 without them)."""
    checks = []
    metrics = result.metrics[main]
    max_kl, max_ppl_increase, min_passkey = astuple(gates)
    if max_kl is not None:
        ok = metrics.mean_kl <= max_kl
        checks.append(Check("gate", PASS if ok else FAIL, f"{main}: mean KL {metrics.mean_kl:.5f}"
                            f" {'<=' if ok else '>'} --max-kl {max_kl}", value=metrics.mean_kl))
    if max_ppl_increase is not None:
        ok = metrics.ppl_change <= max_ppl_increase
        checks.append(Check("gate", PASS if ok else FAIL, f"{main}: perplexity change "
                            f"{metrics.ppl_change:+.2%} {'<=' if ok else '>'} "
                            f"--max-ppl-increase {max_ppl_increase:.2%}",
                            value=metrics.ppl_change))
    if min_passkey is not None:
        if result.passkey is None:
            checks.append(Check("gate", ERROR, "--min-passkey needs --passkey-lengths"))
        else:
            accuracy = result.passkey[main]["accuracy"]
            ok = accuracy >= min_passkey
            checks.append(Check("gate", PASS if ok else FAIL, f"{main}: passkey accuracy "
                                f"{accuracy:.0%} {'>=' if ok else '<'} --min-passkey "
                                f"{min_passkey:.0%}", value=accuracy))
    return checks


def _recommendation_checks(formats: dict[str, Any], gates: Gates, no_passkey: bool
                           ) -> list[Check]:
    """With gates: pass when a quantized format meets them on the target, else fail."""
    if not gates.any_set:
        return []
    if gates.min_passkey is not None and no_passkey:
        return [Check("gate", ERROR, "--min-passkey needs --passkey-lengths")]
    best = formats["recommendation"]
    where = f" on {formats['target']}" if formats["target"] else ""
    if best is None or not best["quantized"]:
        return [Check("gate", FAIL, f"no quantized KV format{where} meets the gates; keep "
                      "the model dtype (--kv-cache-dtype auto)")]
    return [Check("gate", PASS, f"{best['label']} meets the gates{where} with the most "
                  f"tokens at the budget ({best['tokens_at_budget']:,}): {best['flag']}",
                  value=best)]


