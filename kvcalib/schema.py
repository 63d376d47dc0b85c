"""The JSON files kvcalib writes and reads back, as validated pydantic models.

A checkpoint's kvcalib_report.json is untrusted input like every other file in it: it is
validated once, where it is loaded, and a report that does not fit the schema (or comes
from an unknown schema version) is one clear error, never a KeyError three modules later.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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
                              f"{describe(exc)}") from None


def describe(exc: ValidationError) -> str:
    """The first problem and where, without echoing the (untrusted) value."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "top level"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}"
