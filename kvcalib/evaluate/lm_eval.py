"""Task accuracy through lm-evaluation-harness's vLLM backend: the model-dtype cache
(`auto`), an FP8 cache at scale 1.0 (the same weights without KV scales) and an FP8 cache
with the checkpoint's scales, on the same examples, compared example by example.

The default suite is RULER's needle-in-a-haystack tasks that build their haystacks
locally (niah_single_1: a repeated filler text; niah_multikey_2/3: a haystack of
distractor needles), at each context length asked for. The essay variants (niah_single_2/3,
niah_multikey_1, niah_multivalue, niah_multiquery) download Paul Graham's essays and need
NLTK's punkt_tab; they run only where both are already on disk. Any other lm-eval task
runs the same way, where its data can be had offline.

Each configuration is one engine start (kvcalib/verify/probe/lm_eval_probe.py in the
serving environment); `auto` is given to vLLM by the model dtype's name, since vLLM
resolves `auto` to fp8 for a checkpoint with a kv_cache_scheme. Examples are paired by
(task, length, doc id), and must have the same prompt in every configuration. Two
configurations are compared by McNemar's exact test on the examples only one of them gets
right, and by a paired bootstrap interval of their accuracy difference; "better" is said
only when both are outside noise.
"""

from __future__ import annotations

import math
import tempfile
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from kvcalib.checkpoint.layouts import find_scales
from kvcalib.checkpoint.safetensors import tensor_index
from kvcalib.checkpoint.write import write_without_kv_scales
from kvcalib.checks import ERROR, FAIL, PASS, SKIP, Check, exit_code
from kvcalib.choices import OptionGroup, option
from kvcalib.errors import UsageError
from kvcalib.evaluate.stats import MIN_SAMPLES, bootstrap, paired_bootstrap, too_few
from kvcalib.files import load_config
from kvcalib.kvcache import geometry
from kvcalib.verify import engine
from kvcalib.verify.options import vllm_python_option
from kvcalib.verify.probe_answer import LmEvalAnswer

PROBE = engine.PROBE.parent / "lm_eval_probe.py"
OFFLINE_NIAH = ["niah_single_1", "niah_multikey_2", "niah_multikey_3"]
# RULER tasks whose data are generated per context length (lm_eval/tasks/ruler/).
RULER = {*OFFLINE_NIAH, "niah_single_2", "niah_single_3", "niah_multikey_1",
         "niah_multivalue", "niah_multiquery", "ruler_vt", "ruler_cwe", "ruler_fwe",
         "ruler_qa_squad", "ruler_qa_hotpot"}
AUTO, SCALE_ONE, FP8 = "auto", "fp8-scale-one", "fp8"
CONFIGS = {AUTO: "auto", SCALE_ONE: "fp8", FP8: "fp8"}  # name -> vLLM kv_cache_dtype
DEPTH_BUCKETS = 5  # needle depth in fifths of the haystack
ALPHA = 0.05  # McNemar's significance level


@dataclass(frozen=True)
class LmEvalOptions(OptionGroup):
    """The tasks, lengths and configurations, the recovery gate, and how vLLM starts."""

    tasks: list[str] = option(OFFLINE_NIAH, "lm-eval tasks, comma separated (RULER tasks "
                              "run at every --lengths).", comma=str)
    lengths: list[int] = option([1024], "Context lengths (tokens) of the RULER tasks, "
                                "comma separated.", comma=int, low=256)
    limit: int = option(20, "Examples per task and length.", low=1)
    configs: list[str] = option(list(CONFIGS), "Configurations: auto (model-dtype cache), "
                                "fp8-scale-one (FP8 without the checkpoint's scales), fp8 "
                                "(with them); comma separated.", comma=str)
    min_recovery: float = option(0.95, "Fail (exit 1) when FP8 with the checkpoint's scales "
                                 "keeps less than this fraction of auto's accuracy.",
                                 low=0, high=10)
    max_model_len: int | None = option(None, "vLLM max_model_len (default: the largest "
                                       "--lengths).", low=1)
    vllm_python: str | None = vllm_python_option()
    timeout: float = option(3600, "Seconds each configuration may take.", low=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown or not self.configs:
            raise UsageError(f"unknown --configs {', '.join(unknown) or '(none)'}; choose "
                             f"from {', '.join(CONFIGS)}")
        if not self.tasks:
            raise UsageError("--tasks names no task")
        if self.max_model_len is not None and self.max_model_len < max(self.lengths):
            raise UsageError(f"--max-model-len {self.max_model_len} is below the longest "
                             f"--lengths {max(self.lengths)}")


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


def mcnemar(b: int, c: int) -> float:
    """McNemar's exact test: the two-sided binomial p-value of b successes in b + c
    discordant pairs with p = 1/2 (1.0 when there are none)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def depth_bucket(needle: list[int] | None) -> str | None:
    """'0-20%'...'80-100%': where the answer sits in the haystack (None: not RULER)."""
    if needle is None:
        return None
    start, at, end = needle
    fifth = min(int((at - start) / (end - start) * DEPTH_BUCKETS), DEPTH_BUCKETS - 1)
    width = 100 // DEPTH_BUCKETS
    return f"{fifth * width}-{(fifth + 1) * width}%"


def score(sample: dict[str, Any]) -> float:
    """An example's score: RULER's per-length metric (the fraction of its needles found),
    else the task's first metric."""
    metrics = sample["metrics"]
    if sample["length"] is not None and str(sample["length"]) in metrics:
        return float(metrics[str(sample["length"])])
    return float(next(iter(metrics.values())))


def _records(probe: dict[str, Any]) -> list[dict[str, Any]]:
    """The probe's samples, one per example (the task's first filter only)."""
    first_filter: dict[str, str] = {}
    rows = []
    for sample in probe["samples"]:
        if first_filter.setdefault(sample["task"], sample["filter"]) != sample["filter"]:
            continue
        rows.append({"task": sample["task"], "length": sample["length"],
                     "doc_id": sample["doc_id"], "prompt_hash": sample["prompt_hash"],
                     "score": score(sample), "depth": depth_bucket(sample["needle"]),
                     "target": sample["target"], "response": sample["response"]})
    return rows


def _key(sample: dict[str, Any]) -> tuple[str, int | None, int]:
    return sample["task"], sample["length"], sample["doc_id"]


@dataclass
class LmEvalResult:
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

    @property
    def exit_code(self) -> int:
        """2: no configuration was scored; 1: FP8 with the checkpoint's scales recovers less
        than --min-recovery of auto's accuracy; else 0."""
        return exit_code(self.checks)

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


def wilson(successes: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval of a proportion: unlike a bootstrap of 0/1 scores, it does
    not shrink to a point at 0% or 100% (50 of 50 right: 92.9% to 100%)."""
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


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


def lm_eval(checkpoint: str | Path, options: LmEvalOptions, log_dir: Path,
            log: Callable[[str], None]) -> LmEvalResult:
    """One engine start per configuration; every example's score, paired."""
    folder, python = engine.serving_checkpoint(checkpoint, options.vllm_python)
    notes = []
    if FP8 in options.configs and not find_scales(tensor_index(folder))[0]:
        notes.append("the checkpoint has no KV scales: fp8 runs at scale 1.0 too")
    fp8_ok = any(CONFIGS[c] == "fp8" for c in options.configs) and engine.fp8_kv_supported(python)
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvcalib-scale-one-") as scratch:
        for name in options.configs:
            dtype = CONFIGS[name]
            if dtype == "fp8" and not fp8_ok:
                runs.append(ConfigRun(name, dtype, False, engine.FP8_KV_UNSUPPORTED))
                log(f"{name}: skipped, {runs[-1].reason}")
                continue
            model = folder
            if name == SCALE_ONE:
                model = Path(scratch) / folder.name
                model.mkdir()
                dropped = write_without_kv_scales(folder, model)
                log(f"{name}: {len(dropped)} KV scale tensors left out of a linked view")
            runs.append(_score(python, name, model, options, log_dir, log))
    return LmEvalResult(str(checkpoint), _described(options), runs, python, notes)


def _described(options: LmEvalOptions) -> dict[str, Any]:
    return {"tasks": options.tasks, "lengths": options.lengths, "limit": options.limit,
            "configs": options.configs, "min_recovery": options.min_recovery,
            "max_model_len": options.max_model_len or max(options.lengths)}


@dataclass(frozen=True)
class LmEvalRequest:
    """The lm-eval probe's REQUEST.json (see lm_eval_probe.py)."""

    model: Path
    kv_cache_dtype: str
    max_model_len: int
    length_tasks: list[str]
    plain_tasks: list[str]
    lengths: list[int]
    limit: int


def _score(python: str, name: str, model: Path, options: LmEvalOptions, log_dir: Path,
           log: Callable[[str], None]) -> ConfigRun:
    dtype = geometry.served_cache_dtype(CONFIGS[name], load_config(model))
    ask = LmEvalRequest(model, dtype, options.max_model_len or max(options.lengths),
                        [t for t in options.tasks if t in RULER],
                        [t for t in options.tasks if t not in RULER], options.lengths,
                        options.limit)
    log_path = log_dir / f"lm-eval-{name}.log"
    log(f"{name}: lm-eval through vLLM with kv_cache_dtype={dtype}; log: {log_path}")
    probe = engine.run_probe(python, ask, log_path, options.timeout, script=PROBE,
                             answer=LmEvalAnswer)
    result = probe.result
    if result.get("error"):
        why = probe.facts.hardware or result["error"]
        return ConfigRun(name, dtype, False, why.splitlines()[-1], str(log_path),
                         result.get("start_seconds"))
    return ConfigRun(name, dtype, True, None, str(log_path), result.get("start_seconds"),
                     _records(result))
