"""The JSON files kvcalib writes and reads back, as validated pydantic models.

A checkpoint's kvcalib_report.json is untrusted input like every other file in it: it is
validated once, where it is loaded, and a report that does not fit the schema (or comes
from an unknown schema version) is one clear error, never a KeyError three modules later.
"""

from __future__ import annotations

import json
import reprlib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from kvcalib.checkpoint import CheckpointError, read_json

REPORT_FILE = "kvcalib_report.json"
REPORT_SCHEMA_VERSION = 1

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelInfo(_Record):
    source: str
    path: str
    architecture: str
    model_type: str | None


class SchemeInfo(_Record):
    num_bits: int
    type: str
    format: str
    fp8_max: FiniteFloat
    strategy: Literal["tensor", "attn_head"]
    q_scale: bool
    observer: str


class DatasetInfo(_Record):
    """Which text calibration read, and exactly which rows and tokens."""

    source: str
    config: str | None
    split: str | None
    text_column: str
    num_rows: Count
    seed: int
    token_ids_sha256: str
    rows_used: list[Count]


class SamplesInfo(_Record):
    requested: Annotated[int, Field(ge=1)]
    used: Count
    max_seq_len: Annotated[int, Field(ge=1)]
    num_tokens: Count
    seed: int


class PipelineInfo(_Record):
    requested: str
    used: str
    reason: str


class ComputeInfo(_Record):
    device: str
    dtype: str
    checkpoint_dtype: str
    attention: Literal["eager", "sdpa"] = "eager"  # earlier reports lack it: all were eager


class ScaleConvergence(_Record):
    """How one stored scale's running absmax grew over the samples (kvcalib.convergence)."""

    steps: list[tuple[Annotated[int, Field(ge=1)], FiniteFloat]]  # sample, new running absmax
    reached_at: Annotated[int, Field(ge=1)]
    last_half_growth: FiniteFloat | None


class LayerRecord(_Record):
    """One attention layer: its scales as saved and the absmax kvcalib's hooks saw, per head
    (a per-tensor scale is a list of one)."""

    layer: Count
    module: str
    k_scale: list[FiniteFloat]
    k_absmax: list[FiniteFloat]
    v_scale: list[FiniteFloat]
    v_absmax: list[FiniteFloat]
    q_scale: list[FiniteFloat] | None = None
    q_absmax: list[FiniteFloat] | None = None
    # Reports written before convergence was recorded have none.
    k_convergence: list[ScaleConvergence] | None = None
    v_convergence: list[ScaleConvergence] | None = None
    q_convergence: list[ScaleConvergence] | None = None


class RankShare(_Record):
    rank: Count
    samples: tuple[Count, Count]  # first and last, 1-based
    rows: list[Count]


class DistributedInfo(_Record):
    world_size: Annotated[int, Field(ge=1)]
    backend: str | None
    ranks: list[RankShare]


class MemoryInfo(_Record):
    """Bytes one rank was planned to need and found free (kvcalib.memory)."""

    weights: Count
    activations: Count
    needed: Count
    free: Count
    capped: bool


class WeightsInfo(_Record):
    requested: str
    used: str
    reason: str


class WeightQuantizationInfo(_Record):
    """Quantized weights: already in the input (its files copied bit for bit), or quantized
    by this run's --scheme preset; their compressed-tensors groups and ignores."""

    quantized_by: Literal["input", "run"]
    preset: str | None
    format: str | None
    config_groups: dict[str, dict[str, Any]]
    ignore: list[str]


class ConvergenceFlag(_Record):
    layer: Count
    kind: Literal["k", "v", "q"]
    last_half_growth: FiniteFloat
    heads: list[Count] | None


class ConvergenceInfo(_Record):
    late_growth_threshold: FiniteFloat
    flagged: list[ConvergenceFlag]
    note: str


class CalibrationReport(_Record):
    """kvcalib_report.json: what `kvcalib run` measured, on what, with what."""

    schema_version: int = REPORT_SCHEMA_VERSION  # reports before the field was added: 1
    kvcalib_version: str
    created: str
    model: ModelInfo
    scheme: SchemeInfo
    dataset: DatasetInfo
    samples: SamplesInfo
    pipeline: PipelineInfo
    compute: ComputeInfo
    # Recorded since distributed calibration; older reports lack them.
    distributed: DistributedInfo | None = None
    memory: MemoryInfo | None = None
    weights: WeightsInfo | None = None
    weight_quantization: WeightQuantizationInfo | None = None  # None: unquantized weights
    convergence: ConvergenceInfo | None = None
    versions: dict[str, str]
    timings_s: dict[str, FiniteFloat]
    layers: list[LayerRecord]


class ReadScale(_Record):
    """One attention layer's scales as vLLM's worker holds them after loading (NaN and
    infinities are facts to report here, not invalid input)."""

    kv_cache_dtype: str
    k: list[float] | None = None
    v: list[float] | None = None
    q: list[float] | None = None
    k_float: float | None = None
    v_float: float | None = None
    q_float: float | None = None


class ProbeOutput(_Record):
    text: str
    token_ids: list[int]
    prompt_logprobs: list[tuple[int, float, int]]  # token, its log-prob, the top-1 token


class ProbeAnswer(_Record):
    """What kvcalib/probe/vllm_probe.py answers from the serving environment."""

    schema_version: int
    started: StrictBool
    error: str | None
    vllm_version: str | None = None
    platform: dict[str, str | bool] | None = None
    start_seconds: float | None = None
    scales: dict[str, ReadScale] | None = None
    outputs: list[ProbeOutput] | None = None


def load_probe_answer(text: str) -> dict[str, Any]:
    """The probe's answer, validated; an answer that does not fit (another kvcalib's probe,
    a truncated file) becomes an engine error that says so."""
    from kvcalib.probe.vllm_probe import SCHEMA_VERSION

    try:
        data = json.loads(text)
        version = data.get("schema_version") if isinstance(data, dict) else None
        if version != SCHEMA_VERSION:
            raise ValueError(f"schema version {reprlib.repr(version)}, this kvcalib reads "
                             f"{SCHEMA_VERSION}")
        return ProbeAnswer.model_validate(data).model_dump()
    except ValidationError as exc:
        why = describe(exc)
    except ValueError as exc:  # JSONDecodeError included
        why = str(exc)
    return {"started": False, "error": f"the engine probe's answer is unreadable: {why}"}


def load_report(folder: Path) -> CalibrationReport | None:
    """The checkpoint's calibration report, None when it has none."""
    path = Path(folder) / REPORT_FILE
    if not path.exists() and not path.is_symlink():
        return None
    data = read_json(folder, REPORT_FILE, what="calibration report")
    if not isinstance(data, dict):
        raise CheckpointError(f"{REPORT_FILE} is not a kvcalib calibration report: top level: "
                              "not a JSON object")
    version = data.get("schema_version", REPORT_SCHEMA_VERSION)
    if version != REPORT_SCHEMA_VERSION:
        raise CheckpointError(f"{REPORT_FILE} has schema version {reprlib.repr(version)}; this "
                              f"kvcalib reads version {REPORT_SCHEMA_VERSION}")
    try:
        return CalibrationReport.model_validate(data)
    except ValidationError as exc:
        raise CheckpointError(f"{REPORT_FILE} is not a kvcalib calibration report: "
                              f"{describe(exc)}") from None


def describe(exc: ValidationError) -> str:
    """The first problem and where, without echoing the (untrusted) value."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "top level"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}"
