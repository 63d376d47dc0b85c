"""Bad input to `kvcalib run` that is refused before any model loads."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from conftest import assert_error, kvcalib_run, run_kvcalib


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


@pytest.mark.parametrize("value", [["compressed-tensors"], "fp8"])
def test_a_quantization_config_that_is_not_an_object(value, tiny_model, tmp_path):
    """Once an AttributeError traceback from `run`; verify fails it as a check."""
    model = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "quantization_config": value}))
    assert_error(kvcalib_run(model, tmp_path / "out"), 2,
                 f"quantization_config must be a JSON object, not {type(value).__name__}")
    assert not (tmp_path / "out").exists()
    result = run_kvcalib("verify", model, "--static-only")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "quantization_config must be a JSON object" in result.stdout
