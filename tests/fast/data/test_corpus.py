"""The built-in offline corpus: real text that ships with Python."""

from __future__ import annotations

from kvcalib.data import corpus


def test_builtin_corpus_is_long_real_text():
    docs = corpus.documents()
    assert len(docs) > 200
    assert all(len(d["text"]) >= corpus.MIN_DOCUMENT_CHARS for d in docs)
    assert len({d["id"] for d in docs}) == len(docs)
    ids = {d["id"] for d in docs}
    assert "topic:assignment" in ids and "module:json" in ids
    assert corpus.documents() == docs  # the cached copy reads back the same
