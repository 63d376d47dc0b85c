"""Dataset forms, rendering and reproducible sample selection."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from kvcalib.data import DatasetSpec, select_samples
from kvcalib.errors import UsageError

TEXTS = [f"Document number {i}. " + "The quick brown fox jumps over the lazy dog. " * (i + 1)
         for i in range(12)]


@pytest.fixture(scope="module")
def tokenizer(demo_model):
    return AutoTokenizer.from_pretrained(demo_model)


def _pick(tokenizer, source, n=5, max_len=64, seed=0, **kwargs):
    column = kwargs.pop("text_column", None)
    return select_samples(DatasetSpec(str(source), text_column=column), tokenizer, n, max_len,
                          seed, **kwargs)


def _expected_ids(tokenizer, texts, rows, max_len):
    return [tokenizer(texts[r], truncation=True, max_length=max_len)["input_ids"] for r in rows]


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_local_file_formats(fmt, tokenizer, tmp_path):
    import datasets

    path = tmp_path / f"data.{fmt}"
    ds = datasets.Dataset.from_dict({"text": TEXTS, "other": list(range(len(TEXTS)))})
    {"jsonl": lambda: ds.to_json(path), "json": lambda: path.write_text(json.dumps(
        [{"text": t} for t in TEXTS])), "csv": lambda: ds.to_csv(path),
     "parquet": lambda: ds.to_parquet(path)}[fmt]()
    samples = _pick(tokenizer, path)
    assert len(samples.token_ids) == 5
    assert samples.token_ids == _expected_ids(tokenizer, TEXTS, samples.rows, 64)
    assert samples.dataset["text_column"] == "text"


def test_txt_files_are_one_document_each(tokenizer, tmp_path):
    for i, text in enumerate(TEXTS[:3]):
        (tmp_path / f"{i}.txt").write_text(text)
    samples = _pick(tokenizer, tmp_path, n=10, max_len=1000)
    assert len(samples.token_ids) == 3
    assert sorted(map(len, samples.token_ids)) == sorted(
        len(tokenizer(t)["input_ids"]) for t in TEXTS[:3])


def test_single_txt_file(tokenizer, tmp_path):
    (tmp_path / "a.txt").write_text(TEXTS[5])
    samples = _pick(tokenizer, tmp_path / "a.txt", n=1, max_len=16)
    assert samples.token_ids == [tokenizer(TEXTS[5])["input_ids"][:16]]


def test_chat_messages_use_the_chat_template(tokenizer, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"},
                          {"role": "assistant", "content": f"Answer {i}."}]} for i in range(4)]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = _pick(tokenizer, path, n=4, max_len=256)
    for ids, row in zip(samples.token_ids, samples.rows, strict=True):
        rendered = tokenizer.apply_chat_template(rows[row]["messages"], tokenize=False)
        assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids).startswith("<|im_start|>system")


def test_text_column_option(tokenizer, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"body": t, "text": ""}) + "\n" for t in TEXTS))
    samples = _pick(tokenizer, path, text_column="body")
    assert samples.token_ids == _expected_ids(tokenizer, TEXTS, samples.rows, 64)
    with pytest.raises(UsageError, match="no column 'missing'; columns: \\['body', 'text'\\]"):
        _pick(tokenizer, path, text_column="missing")


def test_selection_is_seeded_and_respects_exclusions(tokenizer, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    a, b, c = (_pick(tokenizer, path, seed=s) for s in (0, 0, 1))
    assert a.rows == b.rows and a.digest() == b.digest()
    assert a.rows != c.rows
    held_out = _pick(tokenizer, path, n=20, exclude_rows=set(a.rows))
    assert set(held_out.rows).isdisjoint(a.rows)
    assert len(held_out.rows) == len(TEXTS) - 5  # fewer than asked: what exists


def test_empty_rows_are_skipped_and_zero_usable_is_an_error(tokenizer, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "   "}) + "\n" + json.dumps({"text": "Hello world"}) + "\n")
    assert len(_pick(tokenizer, path, n=5).token_ids) == 1
    path.write_text(json.dumps({"text": ""}) + "\n")
    with pytest.raises(UsageError, match="no usable rows in column 'text'"):
        _pick(tokenizer, path)


def test_mixed_formats_in_a_folder(tokenizer, tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    (tmp_path / "b.csv").write_text("text\ny\n")
    with pytest.raises(UsageError, match="mixes file formats"):
        _pick(tokenizer, tmp_path)


def test_hub_dataset_offline_is_a_clear_error(tokenizer, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UsageError, match="Hub cannot be reached and it is not in the local cache"):
        _pick(tokenizer, "HuggingFaceH4/ultrachat_200k")
