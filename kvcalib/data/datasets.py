"""Calibration and evaluation text: load a dataset, render rows, pick samples reproducibly.

A dataset is one of:
- "builtin": the offline corpus of kvcalib.data.corpus;
- a local .jsonl/.json/.parquet/.csv/.txt file, or a folder of them (one format);
- a Hugging Face Hub dataset id, with an optional config and split.

Rows with chat `messages` are rendered with the tokenizer's chat template; rows with
a text column are used as they are.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcalib.choices import option
from kvcalib.data import corpus
from kvcalib.errors import UsageError
from kvcalib.hub import hub_reachable

DEFAULT_DATASET = "HuggingFaceH4/ultrachat_200k"
# The split to read of hub datasets without a "train" split, unless one is named.
DEFAULT_SPLITS = {DEFAULT_DATASET: "train_sft"}
_LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Characters per token are below this for any real tokenizer; cutting text there first
# keeps tokenization cheap on long documents without changing the first tokens.
_MAX_CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class DatasetSpec:
    """Which dataset the user asked for."""

    source: str = option(DEFAULT_DATASET, "'builtin' (offline corpus), a local .jsonl/.json/"
                         ".parquet/.csv/.txt file or folder, or a hub dataset id.", "--dataset")
    config: str | None = option(None, "Hub dataset config name.", "--dataset-config")
    split: str | None = option(None, "Hub dataset split (default: train_sft for "
                               "ultrachat_200k, else train).")
    text_column: str | None = option(None, "Column with text or chat messages (default: "
                                     "messages, then text).")

    @property
    def hub_split(self) -> str | None:
        return self.split or DEFAULT_SPLITS.get(self.source)

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "config": self.config, "split": self.hub_split}


@dataclass
class Samples:
    """Token ids of the chosen samples, the dataset rows they came from, and identity."""

    token_ids: list[list[int]]
    rows: list[int]
    dataset: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids in self.token_ids)

    def digest(self) -> str:
        return token_ids_digest(self.token_ids)


def token_ids_digest(token_ids: list[list[int]]) -> str:
    """sha256 over the exact token ids, sample by sample (length-prefixed)."""
    import numpy as np

    h = hashlib.sha256()
    for ids in token_ids:
        h.update(len(ids).to_bytes(8, "little"))
        h.update(np.asarray(ids, dtype="<i8").tobytes())
    return h.hexdigest()


def load_rows(spec: DatasetSpec):
    """The dataset as a `datasets.Dataset`; user errors become UsageError."""
    import datasets

    if spec.source == corpus.NAME:
        return datasets.Dataset.from_list(corpus.documents())
    path = Path(spec.source).expanduser()
    if path.exists():
        return _load_local(path)
    if spec.source.startswith((".", "/", "~")) or Path(spec.source).suffix in (
        *_LOCAL_FORMATS, ".txt"
    ):
        raise UsageError(f"dataset not found: {spec.source}")
    return _load_hub(spec)


def _load_local(path: Path):
    import datasets

    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    files = [f for f in files if f.suffix in (*_LOCAL_FORMATS, ".txt")]
    if not files:
        raise UsageError(f"no .jsonl, .json, .parquet, .csv or .txt files in {path}")
    suffixes = {f.suffix for f in files}
    if suffixes == {".txt"}:  # one document per file: samples can be long
        rows = [{"id": str(f), "text": f.read_text(encoding="utf-8", errors="replace")}
                for f in files]
        return datasets.Dataset.from_list(rows)
    builders = {_LOCAL_FORMATS.get(s, "text") for s in suffixes}
    if len(builders) > 1:
        raise UsageError(f"{path} mixes file formats {sorted(suffixes)}; use one format")
    try:
        return datasets.load_dataset(builders.pop(), data_files=[str(f) for f in files],
                                     split="train")
    except Exception as exc:  # datasets raises many types for unreadable files
        raise UsageError(f"cannot read dataset {path}: {exc}") from None


def _load_hub(spec: DatasetSpec):
    import datasets

    if not hub_reachable():
        datasets.config.HF_HUB_OFFLINE = True  # use a cached copy, without retries
    try:
        return datasets.load_dataset(spec.source, spec.config, split=spec.hub_split or "train")
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if datasets.config.HF_HUB_OFFLINE:
            reason = "the Hugging Face Hub cannot be reached and it is not in the local cache"
        raise UsageError(
            f"dataset {spec.source!r} is not a local file or folder, and loading it from "
            f"the Hub failed: {reason}. Use --dataset builtin for the offline corpus, or a "
            "local file."
        ) from None


def text_column_of(columns: list[str], requested: str | None) -> str:
    if requested is not None:
        if requested not in columns:
            raise UsageError(f"dataset has no column {requested!r}; columns: {columns}")
        return requested
    for candidate in ("messages", "text", "content", "prompt"):
        if candidate in columns:
            return candidate
    raise UsageError(f"dataset has no text or messages column (columns: {columns}); "
                     "name one with --text-column")


def render(row_value: Any, tokenizer, max_chars: int) -> tuple[str, bool]:
    """A row's text, and whether it already holds special tokens (chat-rendered)."""
    if isinstance(row_value, list):
        if getattr(tokenizer, "chat_template", None) is None:
            raise UsageError("dataset rows are chat messages, but the tokenizer has no "
                             "chat template; pass a text column with --text-column")
        return tokenizer.apply_chat_template(row_value, tokenize=False), True
    if not isinstance(row_value, str):
        return "", False
    return row_value[:max_chars], False


def select_samples(
    spec: DatasetSpec,
    tokenizer,
    num_samples: int,
    max_seq_len: int,
    seed: int,
    exclude_rows: set[int] | frozenset[int] = frozenset(),
    min_tokens: int = 2,
) -> Samples:
    """Pick up to `num_samples` rows in a seeded random order, tokenized and truncated.

    The same dataset, tokenizer, arguments and seed give the same token ids.
    """
    import numpy as np

    rows = load_rows(spec)
    if len(rows) == 0:
        raise UsageError(f"dataset {spec.source} is empty")
    column = text_column_of(list(rows.column_names), spec.text_column)
    order = np.random.default_rng(seed).permutation(len(rows))
    token_ids: list[list[int]] = []
    used: list[int] = []
    for index in order.tolist():
        if index in exclude_rows:
            continue
        text, templated = render(rows[index][column], tokenizer, max_seq_len * _MAX_CHARS_PER_TOKEN)
        if not text.strip():
            continue
        ids = tokenizer(text, add_special_tokens=not templated, truncation=True,
                        max_length=max_seq_len)["input_ids"]
        if len(ids) < min_tokens:
            continue
        token_ids.append(list(ids))
        used.append(index)
        if len(token_ids) == num_samples:
            break
    if not token_ids and exclude_rows:
        raise UsageError(f"every usable row of dataset {spec.source} was used for calibration "
                         f"({len(exclude_rows)} rows): pass --dataset with other text")
    if not token_ids:
        raise UsageError(f"dataset {spec.source} has no usable rows in column {column!r}")
    identity = {**spec.describe(), "text_column": column, "num_rows": len(rows),
                "seed": seed, "token_ids_sha256": token_ids_digest(token_ids)}
    return Samples(token_ids, used, identity)
