"""Comparing two engine runs on the same prompts: capacity, greedy outputs, prompt
log-probs and perplexity."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvcalib.engine.process import ProbeRun


def compare_runs(fp8: ProbeRun, base: ProbeRun) -> dict[str, Any]:
    """FP8 against the model-dtype cache: capacity, greedy outputs, prompt log-probs."""
    comparison: dict[str, Any] = {"fp8": fp8.kv_cache_dtype, "auto": base.kv_cache_dtype}
    if fp8.facts.capacity and base.facts.capacity:
        tokens = fp8.facts.capacity["tokens"], base.facts.capacity["tokens"]
        comparison["capacity"] = {"fp8_tokens": tokens[0], "auto_tokens": tokens[1],
                                  "ratio": round(tokens[0] / tokens[1], 3)}
    outputs = fp8.result.get("outputs"), base.result.get("outputs")
    if not all(outputs):
        comparison["outputs"] = None
        return comparison
    pairs = list(zip(*outputs, strict=True))
    total, agreement, mean_diff = logprob_agreement(*outputs)
    comparison["outputs"] = {
        "prompts": len(outputs[0]), "positions": total,
        "top1_agreement": round(agreement, 4) if total else None,
        "mean_abs_logprob_diff": round(mean_diff, 5) if total else None,
        "greedy_identical": sum(a["token_ids"] == b["token_ids"] for a, b in pairs),
        "greedy": [{"fp8": a["text"], "auto": b["text"]} for a, b in pairs],
        "ppl_fp8": _perplexity(outputs[0]), "ppl_auto": _perplexity(outputs[1]),
    }
    return comparison


def logprob_agreement(a: list[dict[str, Any]], b: list[dict[str, Any]]
                      ) -> tuple[int, float, float]:
    """Two runs' probe outputs on the same prompts: positions scored, the fraction whose
    top-1 tokens agree, and the mean |Δ log-prob| of the prompt tokens (0, nan, nan: none)."""
    agree, diffs = 0, []
    for one, other in zip(a, b, strict=True):
        for (_, lp_a, top_a), (_, lp_b, top_b) in zip(one["prompt_logprobs"],
                                                      other["prompt_logprobs"], strict=True):
            agree += top_a == top_b
            diffs.append(abs(lp_a - lp_b))
    if not diffs:
        return 0, math.nan, math.nan
    return len(diffs), agree / len(diffs), float(np.mean(diffs))


def _perplexity(outputs: list[dict[str, Any]]) -> float:
    """exp(mean negative log-prob) of the prompt tokens, over all prompts."""
    logprobs = [lp for output in outputs for _, lp, _ in output["prompt_logprobs"]]
    return round(math.exp(-sum(logprobs) / len(logprobs)), 5)
