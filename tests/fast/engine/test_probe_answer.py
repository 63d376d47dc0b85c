"""The engine probe's answer is validated where it is read: a malformed answer is an engine
error that says so, never a KeyError in a later check."""

import json
import math

import pytest

from kvcalib.engine.answers import load_probe_answer

GOOD = {"schema_version": 1, "started": True, "error": None, "vllm_version": "0.32.0",
        "platform": {"device": "cpu", "avx512": True, "amx": False}, "start_seconds": 41.5,
        "scales": {"model.layers.0.self_attn.attn": {
            "kv_cache_dtype": "fp8", "k": [0.0123], "v": [0.0045], "q": [float("nan")],
            "k_float": 0.0123, "v_float": 0.0045}},
        "outputs": [{"text": " Paris", "token_ids": [7042], "prompt_logprobs": [[11, -2.5, 11]]}]}


def test_a_valid_answer_is_read_as_written():
    answer = load_probe_answer(json.dumps(GOOD))
    layer = answer["scales"]["model.layers.0.self_attn.attn"]
    assert answer["started"] and layer["k"] == [0.0123] and layer["v_float"] == 0.0045
    assert math.isnan(layer["q"][0])  # an uninitialized q_scale is a finding, not bad JSON
    assert answer["platform"]["avx512"] is True
    assert list(answer["outputs"][0]["prompt_logprobs"][0]) == [11, -2.5, 11]


@pytest.mark.parametrize("text, why", [
    (json.dumps({**GOOD, "schema_version": 2}), "schema version 2, this kvcalib reads 1"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "schema_version"}), "schema version None"),
    (json.dumps(GOOD)[:40], "Unterminated string"),
    ("[]", "schema version None"),
    (json.dumps({**GOOD, "scales": {"a": {"k": [1.0]}}}), "scales.a.kv_cache_dtype"),
    (json.dumps({**GOOD, "started": "yes"}), "started"),
])
def test_a_malformed_answer_is_an_engine_error(text, why):
    answer = load_probe_answer(text)
    assert answer["started"] is False
    assert answer["error"].startswith("the engine probe's answer is unreadable: ")
    assert why in answer["error"]
