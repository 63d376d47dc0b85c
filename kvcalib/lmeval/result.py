"""What `kvcalib lm-eval` found: accuracy per configuration, task, length and needle depth,
paired comparisons, recovery and the release checks."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcalib.checks import ERROR, FAIL, PASS, SKIP, Check, CommandResult
from kvcalib.errors import UsageError
from kvcalib.lmeval.options import AUTO, FP8, SCALE_ONE
from kvcalib.lmeval.summary import lm_eval_summary
from kvcalib.stats import MIN_SAMPLES, bootstrap, mcnemar, paired_bootstrap, too_few, wilson

DEPTH_BUCKETS = 5  # needle depth in fifths of the haystack
ALPHA = 0.05  # McNemar's significance level


@dataclass
class ConfigRun:
    """One configuration: its engine start, and its examples' scores (or why none)."""

    name: str
    kv_cache_dtype: str
    ran: bool
    reason: str | None = None
    log: str | None = None
    start_seconds: float | None = None
    samples: list[dict[str, Any]] = field(default_factory=list)


def depth_bucket(needle: list[int] | None) -> str | None:
    """'0-20%'...'80-100%': where the answer sits in the haystack (None: not RULER)."""
    if needle is None:
        return None
    start, at, end = needle
    fifth = min(int((at - start) / (end - start) * DEPTH_BUCKETS), DEPTH_BUCKETS - 1)
    width = 100 // DEPTH_BUCKETS
    return f"{fifth * width}-{(fifth + 1) * width}%"


def example_score(sample: dict[str, Any]) -> float:
    """An example's score: RULER's per-length metric (the fraction of its needles found),
    else the task's first metric."""
    metrics = sample["metrics"]
    if sample["length"] is not None and str(sample["length"]) in metrics:
        return float(metrics[str(sample["length"])])
    return float(next(iter(metrics.values())))


def records(probe: dict[str, Any]) -> list[dict[str, Any]]:
    """The probe's samples, one per example (the task's first filter only)."""
    first_filter: dict[str, str] = {}
    rows = []
    for sample in probe["samples"]:
        if first_filter.setdefault(sample["task"], sample["filter"]) != sample["filter"]:
            continue
        rows.append({"task": sample["task"], "length": sample["length"],
                     "doc_id": sample["doc_id"], "prompt_hash": sample["prompt_hash"],
                     "score": example_score(sample), "depth": depth_bucket(sample["needle"]),
                     "target": sample["target"], "response": sample["response"]})
    return rows


def _key(sample: dict[str, Any]) -> tuple[str, int | None, int]:
    return sample["task"], sample["length"], sample["doc_id"]


@dataclass
class LmEvalResult(CommandResult):
    suite = "kvcalib.lm_eval"

    checkpoint: str
    options: dict[str, Any]
    configs: list[ConfigRun]
    vllm_python: str
    notes: list[str] = field(default_factory=list)

    def _ran(self) -> dict[str, ConfigRun]:
        return {c.name: c for c in self.configs if c.ran}

    def table(self) -> list[dict[str, Any]]:
        """Accuracy per configuration, task and length, with a bootstrap interval."""
        rows = []
        for run in self._ran().values():
            groups: dict[tuple[str, int | None], list[float]] = defaultdict(list)
            for sample in run.samples:
                groups[sample["task"], sample["length"]].append(sample["score"])
            for (task, length), scores in groups.items():
                rows.append({"config": run.name, "task": task, "length": length,
                             **_accuracy(scores)})
        return rows

    def depth_table(self) -> list[dict[str, Any]]:
        """Accuracy per configuration, length and needle depth (RULER tasks together)."""
        rows = []
        for run in self._ran().values():
            groups: dict[tuple[int, str], list[float]] = defaultdict(list)
            for sample in run.samples:
                if sample["depth"] is not None:
                    groups[sample["length"], sample["depth"]].append(sample["score"])
            for (length, depth), scores in sorted(groups.items()):
                rows.append({"config": run.name, "length": length, "depth": depth,
                             "n": len(scores), "accuracy": float(np.mean(scores))})
        return rows

    def accuracy(self, name: str) -> float | None:
        run = self._ran().get(name)
        return float(np.mean([s["score"] for s in run.samples])) if run and run.samples else None

    def recovery(self, name: str) -> float | None:
        """The configuration's accuracy ÷ auto's, over every example."""
        auto, mine = self.accuracy(AUTO), self.accuracy(name)
        return None if not auto or mine is None else mine / auto

    def comparisons(self) -> list[dict[str, Any]]:
        """Every pair of configurations that ran, example by example."""
        ran = self._ran()
        pairs = [(a, b) for a, b in ((AUTO, SCALE_ONE), (AUTO, FP8), (SCALE_ONE, FP8))
                 if a in ran and b in ran]
        return [compare(a, ran[a].samples, b, ran[b].samples) for a, b in pairs]

    @property
    def checks(self) -> list[Check]:
        """What a release gates on: a configuration that could not run is a skip (an error
        when none ran); `quality`: FP8 with the checkpoint's scales keeps at least
        --min-recovery of auto's accuracy. Scale 1.0's recovery is reported, not gated."""
        checks = [Check("lm-eval", SKIP, f"{c.name}: not run: {c.reason}")
                  for c in self.configs if not c.ran]
        if not self._ran():
            return [*checks, Check("lm-eval", ERROR, "no configuration could be scored")]
        gate = self.options["min_recovery"]
        for name in (SCALE_ONE, FP8):
            recovery = self.recovery(name)
            if recovery is None:
                continue
            status = PASS if name == SCALE_ONE or recovery >= gate else FAIL
            checks.append(Check("quality", status, f"{name}: keeps {recovery:.1%} of auto's "
                                f"accuracy (gate {gate:.0%})", value=round(recovery, 4)))
        return checks

    def verdict(self) -> list[str]:
        """Plain sentences: recovery against the gate, and what calibration buys."""
        said = []
        gate = self.options["min_recovery"]
        for name in (SCALE_ONE, FP8):
            recovery = self.recovery(name)
            if recovery is None:
                continue
            below = recovery < gate
            what = "scale 1.0" if name == SCALE_ONE else "the checkpoint's scales"
            said.append(f"FP8 with {what} keeps {recovery:.1%} of auto's accuracy"
                        + (f", below {gate:.0%}" if below else f" (>= {gate:.0%})")
                        + ("; calibrate" if below and name == SCALE_ONE else ""))
        return said

    def to_dict(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "options": self.options,
                "vllm_python": self.vllm_python,
                "configs": [{"name": c.name, "kv_cache_dtype": c.kv_cache_dtype, "ran": c.ran,
                             "reason": c.reason, "log": c.log,
                             "start_seconds": c.start_seconds, "examples": len(c.samples),
                             "accuracy": self.accuracy(c.name),
                             "recovery": self.recovery(c.name)} for c in self.configs],
                "table": self.table(), "depth": self.depth_table(),
                "comparisons": self.comparisons(), "verdict": self.verdict(),
                "notes": self.notes, "checks": [vars(c) for c in self.checks],
                "exit_code": self.exit_code,
                "samples": [{"config": c.name, **s} for c in self.configs for s in c.samples]}

    def summary(self) -> str:
        return lm_eval_summary(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LmEvalResult:
        """to_dict's form read back: the configurations and their examples, from which every
        table, comparison and verdict is computed again."""
        samples = data["samples"]
        configs = [ConfigRun(c["name"], c["kv_cache_dtype"], bool(c["ran"]), c.get("reason"),
                             c.get("log"), c.get("start_seconds"),
                             [{k: v for k, v in s.items() if k != "config"}
                              for s in samples if s["config"] == c["name"]])
                   for c in data["configs"]]
        return cls(str(data["checkpoint"]), dict(data["options"]), configs,
                   str(data["vllm_python"]), list(data.get("notes", [])))


def _accuracy(scores: list[float]) -> dict[str, Any]:
    """Mean score with its 95% interval: Wilson's for right/wrong scores, a bootstrap for
    partial ones (tasks that score a fraction of several needles)."""
    mean = float(np.mean(scores))
    if too_few(len(scores)):
        return {"n": len(scores), "accuracy": mean, "low": None, "high": None}
    if set(scores) <= {0.0, 1.0}:
        low, high = wilson(sum(scores), len(scores))
    else:
        found = bootstrap(np.array(scores))
        low, high = found.low, found.high
    return {"n": len(scores), "accuracy": mean, "low": low, "high": high}


def compare(a: str, a_samples: list[dict[str, Any]], b: str,
            b_samples: list[dict[str, Any]]) -> dict[str, Any]:
    """b against a on the examples both scored: discordant counts, McNemar's p, the
    bootstrap interval of accuracy(b) - accuracy(a), and whether b is better, worse or
    within noise (better or worse only when McNemar's p < 0.05 and the interval excludes
    zero)."""
    by_key = {_key(s): s for s in b_samples}
    pairs = [(s, by_key[_key(s)]) for s in a_samples if _key(s) in by_key]
    differ = [_key(x) for x, y in pairs if x["prompt_hash"] != y["prompt_hash"]]
    if differ:
        raise UsageError(f"{a} and {b} scored different prompts for {differ[0]}: lm-eval "
                         "did not generate the same examples in both runs")
    left = np.array([x["score"] for x, _ in pairs])
    right = np.array([y["score"] for _, y in pairs])
    only_a = int(np.sum((left >= 1) & (right < 1)))
    only_b = int(np.sum((left < 1) & (right >= 1)))
    p = mcnemar(only_a, only_b)
    found = {"a": a, "b": b, "n": len(pairs), "only_a": only_a, "only_b": only_b,
             "p_value": p, "difference": float(right.mean() - left.mean()) if pairs else None,
             "low": None, "high": None}
    if len(pairs) < MIN_SAMPLES:
        return {**found, "verdict": too_few(len(pairs))}
    interval = paired_bootstrap(left, right).difference
    found.update(low=interval.low, high=interval.high)
    if p < ALPHA and interval.excludes_zero:
        found["verdict"] = f"{b} is {'better' if interval.low > 0 else 'worse'} than {a}"
    else:
        found["verdict"] = "within noise"
    return found
