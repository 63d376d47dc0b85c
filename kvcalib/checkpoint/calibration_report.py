"""kvcalib_report.json, what `kvcalib run` measured, as a validated pydantic model.

`run` builds it as this model and writes it with the checkpoint; every command that reads
it back validates it once, where it is loaded: it is untrusted input like every other
file of a checkpoint, and a report that does not fit the schema (or comes from an unknown
schema version) is one clear error, never a KeyError three modules later.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvcalib.choices import Attention, Strategy
from kvcalib.errors import CheckpointError
from kvcalib.reads import read_json

REPORT_FILE = "kvcalib_report.json"
REPORT_SCHEMA_VERSION = 1

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
Count = Annotated[int, Field(ge=0)]


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelInfo(Record):
    source: str
    path: str
    architecture: str
    model_type: str | None


class SchemeInfo(Record):
    num_bits: int
    type: str
    format: str
    fp8_max: FiniteFloat
    strategy: Strategy
    q_scale: bool
    observer: str


class DatasetInfo(Record):
    """Which text calibration read, and exactly which rows and tokens."""

    source: str
    config: str | None
    split: str | None
    text_column: str
    num_rows: Count
    seed: int
    token_ids_sha256: str
    rows_used: list[Count]


class SamplesInfo(Record):
    requested: Annotated[int, Field(ge=1)]
    used: Count
    max_seq_len: Annotated[int, Field(ge=1)]
    num_tokens: Count
    seed: int


class PipelineInfo(Record):
    requested: str
    used: str
    reason: str


class ComputeInfo(Record):
    device: str
    dtype: str
    checkpoint_dtype: str
    attention: Attention = "eager"  # earlier reports lack it: all were eager


class ScaleConvergence(Record):
    """How one stored scale's running absmax grew over the samples
    (kvcalib.calibrate.convergence)."""

    steps: list[tuple[Annotated[int, Field(ge=1)], FiniteFloat]]  # sample, new running absmax
    reached_at: Annotated[int, Field(ge=1)]
    last_half_growth: FiniteFloat | None


class LayerRecord(Record):
    """One attention layer: its scales as saved and the absmax kvcalib's hooks saw, per head
    (a per-tensor scale is a list of one). Reports written before convergence was recorded
    have none."""

    layer: Count
    module: str
    k_scale: list[FiniteFloat]
    k_absmax: list[FiniteFloat]
    k_convergence: list[ScaleConvergence] | None = None
    v_scale: list[FiniteFloat]
    v_absmax: list[FiniteFloat]
    v_convergence: list[ScaleConvergence] | None = None
    q_scale: list[FiniteFloat] | None = None
    q_absmax: list[FiniteFloat] | None = None
    q_convergence: list[ScaleConvergence] | None = None


class RankShare(Record):
    rank: Count
    samples: tuple[Count, Count]  # first and last, 1-based
    rows: list[Count]


class DistributedInfo(Record):
    world_size: Annotated[int, Field(ge=1)]
    backend: str | None
    ranks: list[RankShare]


class MemoryInfo(Record):
    """Bytes one rank was planned to need and found free (kvcalib.calibrate.memory)."""

    weights: Count
    activations: Count
    needed: Count
    free: Count
    capped: bool


class WeightsInfo(Record):
    requested: str
    used: str
    reason: str


class WeightQuantizationInfo(Record):
    """Quantized weights: already in the input (its files copied bit for bit), or quantized
    by this run's --scheme preset; their compressed-tensors groups and ignores."""

    quantized_by: Literal["input", "run"]
    preset: str | None
    format: str | None
    config_groups: dict[str, dict[str, Any]]
    ignore: list[str]


class ConvergenceFlag(Record):
    layer: Count
    kind: Literal["k", "v", "q"]
    last_half_growth: FiniteFloat
    heads: list[Count] | None


class ConvergenceInfo(Record):
    late_growth_threshold: FiniteFloat
    flagged: list[ConvergenceFlag]
    note: str


class CalibrationReport(Record):
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
                              f"{validation_message(exc)}") from None


def validation_message(exc: ValidationError) -> str:
    """The first problem and where, without echoing the (untrusted) value."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "top level"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}"
