"""Bad input to `kvcalib run` that is refused before any model loads."""

from __future__ import annotations

import time

from conftest import assert_error, kvcalib_run


def test_missing_model_path(tmp_path):
    assert_error(kvcalib_run(tmp_path / "nope", tmp_path / "out"), 2, "model folder not found")


def test_hub_id_offline_fails_fast(tmp_path):
    started = time.monotonic()
    result = kvcalib_run("some-org/some-model", tmp_path / "out",
                         env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert_error(result, 2, "is not a local folder, and the Hugging Face Hub cannot be reached")
    assert time.monotonic() - started < 60


def test_folder_without_config(tmp_path):
    (tmp_path / "m").mkdir()
    assert_error(kvcalib_run(tmp_path / "m", tmp_path / "out"), 2, "has no config.json")


def test_folder_that_is_not_a_causal_lm(tmp_path):
    from transformers import ResNetConfig

    ResNetConfig().save_pretrained(tmp_path / "m")
    assert_error(kvcalib_run(tmp_path / "m", tmp_path / "out"), 2,
                 "is not a causal language model")

