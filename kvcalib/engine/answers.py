"""The probe's answer from the serving environment, as a validated pydantic model: an
answer that does not fit (another kvcalib's probe, a truncated file) is an engine error
that says so, never a KeyError later."""

from __future__ import annotations

import json
import reprlib
from typing import Any

from pydantic import StrictBool, ValidationError

from kvcalib.checkpoint.calibration_report import Record, validation_message
from kvcalib.engine.scripts.probe_protocol import LM_EVAL_PROBE_SCHEMA, VLLM_PROBE_SCHEMA


class ReadScale(Record):
    """One attention layer's scales as vLLM's worker holds them after loading (NaN and
    infinities are facts to report here, not invalid input)."""

    kv_cache_dtype: str
    k: list[float] | None = None
    v: list[float] | None = None
    q: list[float] | None = None
    k_float: float | None = None
    v_float: float | None = None
    q_float: float | None = None


class ProbeOutput(Record):
    text: str
    token_ids: list[int]
    prompt_logprobs: list[tuple[int, float, int]]  # token, its log-prob, the top-1 token


class ProbeAnswer(Record):
    """What kvcalib/probe/vllm_probe.py answers from the serving environment."""

    schema_version: int
    started: StrictBool
    error: str | None
    vllm_version: str | None = None
    platform: dict[str, str | bool] | None = None
    start_seconds: float | None = None
    scales: dict[str, ReadScale] | None = None
    outputs: list[ProbeOutput] | None = None


class LmEvalSample(Record):
    """One example lm-eval scored (kvcalib/engine/scripts/lm_eval_probe.py)."""

    task: str
    length: int | None
    doc_id: int
    prompt_hash: str
    filter: str
    target: Any
    response: str | None
    metrics: dict[str, float]
    needle: tuple[int, int, int] | None


class LmEvalAnswer(Record):
    """What kvcalib/probe/lm_eval_probe.py answers from the serving environment."""

    schema_version: int
    started: StrictBool
    error: str | None
    lm_eval_version: str | None = None
    vllm_version: str | None = None
    start_seconds: float | None = None
    samples: list[LmEvalSample]


SCHEMAS = {ProbeAnswer: VLLM_PROBE_SCHEMA, LmEvalAnswer: LM_EVAL_PROBE_SCHEMA}


def load_probe_answer(text: str, answer: type[Record] = ProbeAnswer) -> dict[str, Any]:
    """The probe's answer, validated as `answer`; an answer that does not fit (another
    kvcalib's probe, a truncated file) becomes an engine error that says so."""
    try:
        data = json.loads(text)
        version = data.get("schema_version") if isinstance(data, dict) else None
        if version != SCHEMAS[answer]:
            raise ValueError(f"schema version {reprlib.repr(version)}, this kvcalib reads "
                             f"{SCHEMAS[answer]}")
        return answer.model_validate(data).model_dump()
    except ValidationError as exc:
        why = validation_message(exc)
    except ValueError as exc:  # JSONDecodeError included
        why = str(exc)
    return {"started": False, "error": f"the engine probe's answer is unreadable: {why}"}


