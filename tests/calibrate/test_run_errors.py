"""Bad input to `kvcalib run`: a clear message, the documented exit code, nothing lost."""

from __future__ import annotations

import json
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import (
    KVCALIB,
    TOKENIZER_FILES,
    assert_error,
    builtin,
    ctrl_c_reaches_it,
    kvcalib_run,
    linked_copy,
    run_kvcalib,
    tree_digest,
)
from kvcalib.calibrate import calibrate
from kvcalib.errors import CheckFailed


def test_folder_with_only_a_config(tiny_model, tmp_path):
    model = linked_copy(tiny_model("llama"), tmp_path / "m", leave_out=(
        "model.safetensors", "generation_config.json", *TOKENIZER_FILES))
    result = kvcalib_run(model, tmp_path / "out")
    assert_error(result, 2, f"{model} has no .safetensors files")
    assert "Loading" not in result.stderr  # refused before loading anything


def test_folder_without_weights(tiny_model, tmp_path):
    model = linked_copy(tiny_model("llama"), tmp_path / "m", leave_out=("model.safetensors",))
    assert_error(kvcalib_run(model, tmp_path / "out"), 2, f"{model} has no .safetensors files")


def test_folder_without_tokenizer(tiny_model, tmp_path):
    model = linked_copy(tiny_model("llama"), tmp_path / "m", leave_out=TOKENIZER_FILES)
    result = kvcalib_run(model, tmp_path / "out")
    assert_error(result, 2, f"cannot load the tokenizer of {model}")
    assert "Calibrating" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_model_without_attention_layers(tiny_model, tmp_path):
    assert_error(kvcalib_run(tiny_model("mamba"), tmp_path / "out"), 2,
                 "MambaForCausalLM has no attention layers llm-compressor can hook")


@pytest.mark.parametrize("option, value, message", [
    # Choices are refused while parsing, naming the allowed ones (listed in --help too).
    ("--strategy", "channel", "'channel' is not one of 'tensor', 'attn_head'"),
    ("--observer", "avg", "'avg' is not one of 'static_minmax', 'minmax', 'mse'"),
    ("--pipeline", "fast", "'fast' is not one of 'auto', 'basic', 'sequential'"),
    ("--num-samples", "0", "Invalid value for '--num-samples'"),
    ("--max-seq-len", "-5", "Invalid value for '--max-seq-len'"),
])
def test_bad_options(option, value, message, tiny_model, tmp_path):
    assert_error(kvcalib_run(tiny_model("llama"), tmp_path / "out", option, value), 2, message)
    assert not (tmp_path / "out").exists()


def _with_dataset(model, tmp_path, dataset: Path):
    return run_kvcalib("run", "--model", model, "--output", tmp_path / "out", "--dataset",
                       dataset, "--num-samples", 2, "--max-seq-len", 16)


def test_missing_dataset(tiny_model, tmp_path):
    assert_error(_with_dataset(tiny_model("llama"), tmp_path, tmp_path / "none.jsonl"), 2,
                 "dataset not found")


def test_empty_dataset(tiny_model, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    assert_error(_with_dataset(tiny_model("llama"), tmp_path, tmp_path / "empty.jsonl"), 2,
                 "empty.jsonl")


def test_dataset_without_text_column(tiny_model, tmp_path):
    (tmp_path / "d.jsonl").write_text('{"label": 1, "score": 0.5}\n' * 3)
    assert_error(_with_dataset(tiny_model("llama"), tmp_path, tmp_path / "d.jsonl"), 2,
                 "has no text or messages column (columns: ['label', 'score'])")


def test_output_not_empty_needs_overwrite(tiny_model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert_error(kvcalib_run(tiny_model("llama"), out), 2, "exists and is not empty")
    assert (out / "keep.txt").read_text() == "precious"
    result = kvcalib_run(tiny_model("llama"), out, "--overwrite")
    assert result.returncode == 0, result.stderr
    assert not (out / "keep.txt").exists() and (out / "kv_scales.safetensors").exists()


def test_output_inside_the_model_folder(tiny_model):
    model = tiny_model("llama")
    before = tree_digest(model)
    assert_error(kvcalib_run(model, model / "calibrated"), 2, "is inside the input model folder")
    assert_error(kvcalib_run(model, model.parent, "--overwrite"), 2,
                 "contains the input model folder")
    assert tree_digest(model) == before


def test_input_folder_is_never_modified(tiny_model, tmp_path):
    model = tiny_model("qwen3")
    before = tree_digest(model)
    assert kvcalib_run(model, tmp_path / "out").returncode == 0
    assert tree_digest(model) == before


def test_write_failure_leaves_nothing(demo_model, tmp_path):
    out = tmp_path / "out"

    def small_file_limit():  # the 269 MB weight copy fails with EFBIG, like a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (10 * 2**20, 10 * 2**20))

    result = kvcalib_run(demo_model, out, preexec_fn=small_file_limit)
    assert_error(result, 2, f"writing {out} failed")
    assert "File too large" in result.stderr
    assert list(tmp_path.iterdir()) == []


def _zeroed_model(tiny_model, tmp_path, value: float) -> Path:
    """A tiny Llama whose first layer's k_proj makes every key `value` (0 or NaN)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"))
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.fill_(value)
    folder = tmp_path / "broken"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_model("llama") / name).read_bytes())
    return folder


def test_zero_scale_is_a_failure_not_a_checkpoint(tiny_model, tmp_path):
    model = _zeroed_model(tiny_model, tmp_path, 0.0)
    assert_error(kvcalib_run(model, tmp_path / "out"), 1,
                 "model.layers.0.self_attn.k_scale: every k value seen was 0")
    assert not (tmp_path / "out").exists()


def test_nan_scale_is_a_failure_not_a_checkpoint(tiny_model, tmp_path):
    with pytest.raises(CheckFailed, match="k_scale came out \\[nan\\]"):
        calibrate(_zeroed_model(tiny_model, tmp_path, float("nan")), tmp_path / "out",
                  samples=builtin(2, 16), log=lambda _: None)
    assert not (tmp_path / "out").exists()


def _start(model, out, *extra) -> subprocess.Popen:
    return subprocess.Popen(
        [str(KVCALIB), "run", "--model", str(model), "--output", str(out), "--dataset",
         "builtin", "--num-samples", "64", "--max-seq-len", "256", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=ctrl_c_reaches_it)


def _wait_for(process: subprocess.Popen, marker: str) -> None:
    for line in process.stderr:
        if line.startswith(marker):
            return
    raise AssertionError(f"{marker!r} never printed; exit {process.wait()}")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_while_calibrating_leaves_nothing(signum, demo_model, tmp_path):
    process = _start(demo_model, tmp_path / "out")
    _wait_for(process, "Calibrating")
    time.sleep(2)
    process.send_signal(signum)  # SIGINT is what Ctrl-C sends
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130
    assert stderr.splitlines()[-1:] == ["Interrupted; nothing was written."], stderr
    assert list(tmp_path.iterdir()) == []


def test_two_runs_to_one_output_never_replace_each_other(tiny_model, tmp_path):
    """Both pass the up-front check; the one finishing second must not replace the first."""
    out = tmp_path / "out"
    first = _start(tiny_model("llama"), out, "--num-samples", "3", "--max-seq-len", "16")
    _wait_for(first, "Loading")  # past its check of --output
    first.send_signal(signal.SIGSTOP)  # hold it there while the second one runs to the end
    try:
        second = kvcalib_run(tiny_model("qwen2"), out)
        assert second.returncode == 0, second.stderr
    finally:
        first.send_signal(signal.SIGCONT)
    _, stderr = first.communicate(timeout=300)
    assert first.returncode == 2, stderr
    assert f"Error: {out} appeared while this run was working" in stderr
    assert "Traceback" not in stderr
    report = json.loads((out / "kvcalib_report.json").read_text())  # the second's, whole
    assert Path(report["model"]["path"]) == tiny_model("qwen2").resolve()
    assert report["samples"]["used"] == 2
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left


def test_kill_while_writing_leaves_no_output_and_keeps_the_old_one(demo_model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("previous checkpoint")
    process = _start(demo_model, out, "--num-samples", "1", "--max-seq-len", "16", "--overwrite")
    _wait_for(process, "Writing")
    process.kill()
    process.wait(timeout=60)
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    assert (out / "old.txt").read_text() == "previous checkpoint"
    # The next run removes what the killed one left behind and completes.
    result = kvcalib_run(demo_model, out, "--overwrite")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert json.loads((out / "kvcalib_report.json").read_text())["samples"]["used"] == 2


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
