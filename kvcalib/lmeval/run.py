"""Task accuracy through lm-evaluation-harness's vLLM backend: the model-dtype cache
(`auto`), an FP8 cache at scale 1.0 (the same weights without KV scales) and an FP8 cache
with the checkpoint's scales, on the same examples, compared example by example.

The default suite is RULER's needle-in-a-haystack tasks that build their haystacks
locally (niah_single_1: a repeated filler text; niah_multikey_2/3: a haystack of
distractor needles), at each context length asked for. The essay variants (niah_single_2/3,
niah_multikey_1, niah_multivalue, niah_multiquery) download Paul Graham's essays and need
NLTK's punkt_tab; they run only where both are already on disk. Any other lm-eval task
runs the same way, where its data can be had offline.

Each configuration is one engine start (kvcalib/engine/scripts/lm_eval_probe.py in the
serving environment); `auto` is given to vLLM by the model dtype's name, since vLLM
resolves `auto` to fp8 for a checkpoint with a kv_cache_scheme. Examples are paired by
(task, length, doc id), and must have the same prompt in every configuration. Two
configurations are compared by McNemar's exact test on the examples only one of them gets
right, and by a paired bootstrap interval of their accuracy difference; "better" is said
only when both are outside noise.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcalib.checkpoint.layouts import find_scales
from kvcalib.checkpoint.safetensors import tensor_index
from kvcalib.checkpoint.write import write_without_kv_scales
from kvcalib.engine.answers import LmEvalAnswer
from kvcalib.engine.interpreter import FP8_KV_UNSUPPORTED, fp8_kv_supported, serving_checkpoint
from kvcalib.engine.process import SCRIPTS, run_probe
from kvcalib.kvcache import geometry
from kvcalib.lmeval.options import CONFIGS, FP8, RULER, SCALE_ONE, LmEvalOptions
from kvcalib.lmeval.result import ConfigRun, LmEvalResult, records
from kvcalib.reads import load_config

PROBE = SCRIPTS / "lm_eval_probe.py"


def lm_eval(checkpoint: str | Path, options: LmEvalOptions, log_dir: Path,
            log: Callable[[str], None]) -> LmEvalResult:
    """One engine start per configuration; every example's score, paired."""
    folder, python = serving_checkpoint(checkpoint, options.vllm_python)
    notes = []
    if FP8 in options.configs and not find_scales(tensor_index(folder))[0]:
        notes.append("the checkpoint has no KV scales: fp8 runs at scale 1.0 too")
    fp8_ok = any(CONFIGS[c] == "fp8" for c in options.configs) and fp8_kv_supported(python)
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvcalib-scale-one-") as scratch:
        for name in options.configs:
            dtype = CONFIGS[name]
            if dtype == "fp8" and not fp8_ok:
                runs.append(ConfigRun(name, dtype, False, FP8_KV_UNSUPPORTED))
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
    probe = run_probe(python, ask, log_path, options.timeout, script=PROBE,
                      answer=LmEvalAnswer)
    result = probe.result
    if result.get("error"):
        why = probe.facts.hardware or result["error"]
        return ConfigRun(name, dtype, False, why.splitlines()[-1], str(log_path),
                         result.get("start_seconds"))
    return ConfigRun(name, dtype, True, None, str(log_path), result.get("start_seconds"),
                     records(result))
