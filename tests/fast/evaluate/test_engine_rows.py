"""eval --engine's weights-only, KV-only and combined rows from vLLM's prompt log-probs
(kvcalib.evaluate.separate.engine_rows), against sums computed here by hand."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from kvcalib.engine.log import LogFacts
from kvcalib.engine.process import ProbeRun
from kvcalib.evaluate.separate import BOTH, KV, WEIGHTS, engine_rows

PROMPTS, POSITIONS = 12, 5


def _run(dtype: str, logprobs: np.ndarray, tops: np.ndarray) -> ProbeRun:
    """A started probe whose answer scores PROMPTS prompts of POSITIONS tokens."""
    outputs = [{"text": "", "token_ids": [1], "prompt_logprobs": [
        [7, float(lp), int(top)] for lp, top in zip(logprobs[i], tops[i], strict=True)]}
        for i in range(PROMPTS)]
    return ProbeRun(dtype, {"started": True, "outputs": outputs}, Path("vllm.log"),
                    LogFacts(), 1.0)


def _logprobs(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return -rng.exponential(2.0, (PROMPTS, POSITIONS)), rng.integers(0, 3, (PROMPTS, POSITIONS))


def test_rows_against_the_reference_run():
    ref_lp, ref_top = _logprobs(0)
    runs = {name: _logprobs(seed) for seed, name in enumerate((WEIGHTS, KV, BOTH), start=1)}
    result = engine_rows(_run("bfloat16", ref_lp, ref_top),
                         {name: _run("fp8", *run) for name, run in runs.items()})
    ref_ppl = math.exp(-ref_lp.sum() / ref_lp.size)
    assert result["reference"]["ppl"] == pytest.approx(ref_ppl)
    for name, (lp, top) in runs.items():
        row = result["rows"][name]
        ppl = math.exp(-lp.sum() / lp.size)
        assert row["ppl"] == pytest.approx(ppl)
        assert row["ppl_change"] == pytest.approx(ppl / ref_ppl - 1)
        assert row["top1_agreement"] == pytest.approx((top == ref_top).mean())
        assert row["mean_abs_logprob_diff"] == pytest.approx(np.abs(lp - ref_lp).mean())
        assert row["vs_reference"]["ppl"]["difference"] == pytest.approx(ppl - ref_ppl)
    # Mean NLL per token: (combined - ref) - ((weights - ref) + (KV - ref)).
    w, kv, both = (-runs[name][0].mean() for name in (WEIGHTS, KV, BOTH))
    ref = -ref_lp.mean()
    expected = (both - ref) - ((w - ref) + (kv - ref))
    interaction = result["interaction"]
    assert interaction["difference"] == pytest.approx(expected)
    assert interaction["low"] <= interaction["difference"] <= interaction["high"]


def test_a_kv_only_view_at_other_scales_is_no_row():
    """compressed-tensors loads missing scales as 1.0 silently: the KV-only run must read
    back the scales the checkpoint's own FP8 run reads back."""
    runs = {name: _run("fp8", *_logprobs(seed)) for seed, name in enumerate((WEIGHTS, KV, BOTH))}
    runs[BOTH].result["scales"] = {"model.layers.0.self_attn.attn": {"k_float": 0.02,
                                                                      "v_float": 0.01}}
    runs[KV].result["scales"] = {"model.layers.0.self_attn.attn": {"k_float": 1.0,
                                                                    "v_float": 1.0}}
    result = engine_rows(_run("bfloat16", *_logprobs(9)), runs)
    assert "other scales than the checkpoint's" in result["rows"][KV]["error"]
    assert result["rows"][BOTH]["loaded_scales"] == {"model.layers.0.self_attn.attn": [0.02,
                                                                                         0.01]}
    runs[KV].result["scales"] = runs[BOTH].result["scales"]
    assert "error" not in engine_rows(_run("bfloat16", *_logprobs(9)), runs)["rows"][KV]


def test_a_row_that_did_not_run_has_its_reason():
    ref = _run("bfloat16", *_logprobs(0))
    failed = ProbeRun("fp8", {"started": False, "error": "RuntimeError: no"}, Path("x.log"),
                      LogFacts(hardware="FP8 KV cache requires AVX-512"), 1.0)
    result = engine_rows(ref, {WEIGHTS: _run("bfloat16", *_logprobs(1)), KV: failed,
                               BOTH: failed})
    assert result["rows"][KV] == {"kv_cache_dtype": "fp8",
                                  "error": "FP8 KV cache requires AVX-512"}
    assert "ppl" in result["rows"][WEIGHTS] and "interaction" not in result
    assert engine_rows(failed, {})["error"] == ("the reference did not run: FP8 KV cache "
                                                "requires AVX-512")
