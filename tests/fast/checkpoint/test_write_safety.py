"""Writing a checkpoint never changes an input file, and never writes one output file
over another (issue 20 §1).

An input whose old KV scales sit in model.safetensors beside its weights in
model-00001-of-00001.safetensors once had its weights truncated through a hard link
(`--weights link`), or lost them in the output (copy, convert), because the lone
model.safetensors was renamed onto the other file's name. The same held for an input
whose weights sit in kv_scales.safetensors, the name of the scales file kvcalib writes.
"""

from __future__ import annotations

import json

import pytest

import tiny_files
from conftest import run_kvcalib, verify_static
from kvcalib.checkpoint import open_model, write_checkpoint
from kvcalib.checkpoint import write as weights
from kvcalib.checkpoint.safetensors import weight_files
from kvcalib.errors import CheckpointError, UsageError
from kvcalib.writes import atomic_output_dir

WEIGHTS = sorted(tiny_files.weight_shapes())
LAYOUTS = {
    # weights in the one-shard name, old scales in model.safetensors
    "one-shard-name-taken": {"model-00001-of-00001.safetensors": WEIGHTS,
                             "model.safetensors": tiny_files.scale_names()},
    # weights in the file name kvcalib writes its scales to
    "scales-name-taken": {"kv_scales.safetensors": WEIGHTS,
                          "model.safetensors": tiny_files.scale_names()},
}


def _input_tensors(src) -> dict:
    stored = {}
    for path in src.glob("*.safetensors"):
        stored.update(tiny_files.peers.raw_tensors(path))
    return stored


def _check_output(src, out) -> None:
    """Every weight of the input is in the output, where the output's index says, with
    the input's bytes; the scales are the new ones."""
    written, stored = tiny_files.indexed_tensors(out), _input_tensors(src)
    for name in WEIGHTS:
        assert written[name] == stored[name], name
    assert set(written) == set(WEIGHTS) | set(tiny_files.scale_names())


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", ["link", "copy", "reflink", "auto"])
def test_no_input_file_changes_in_any_weights_mode(layout, mode, tmp_path):
    src = tiny_files.build(tmp_path / "src", LAYOUTS[layout])
    before = tiny_files.digests(src)
    sources = [src / name for name in weight_files(src)]
    try:
        used, _ = weights.choose_placement(mode, sources, tmp_path)
    except UsageError as exc:  # this filesystem cannot clone: refused up front
        assert mode == "reflink" and "cannot clone" in str(exc)
        return
    scales = {name: ("BF16", (1,), tiny_files.bf16([0.02])) for name in
              tiny_files.scale_names()}
    with atomic_output_dir(tmp_path / "out") as tmp:
        write_checkpoint(tmp, open_model(src), scales, tiny_files.KV_SCHEME, weights=used)
    assert tiny_files.digests(src) == before
    _check_output(src, tmp_path / "out")
    code, report, _ = verify_static(tmp_path / "out", tmp_path)
    assert code == 0, report


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_convert_changes_no_input_file(layout, tmp_path):
    src = tiny_files.build(tmp_path / "src", LAYOUTS[layout])
    before = tiny_files.digests(src)
    result = run_kvcalib("convert", src, "--to", "modelopt", "--output", tmp_path / "out",
                         "--json", "-")
    assert result.returncode == 0, result.stderr
    assert tiny_files.digests(src) == before
    written, stored = tiny_files.indexed_tensors(tmp_path / "out"), _input_tensors(src)
    for name in WEIGHTS:
        assert written[name] == stored[name], name
    assert json.loads(result.stdout)["target_layout"] == "modelopt"


def test_scale_free_view_of_a_tiny_checkpoint(tmp_path):
    """lm-eval's scale-1.0 view: the scale tensors, the index's entries for them and the
    kv_cache_scheme go; every weight stays, linked; the input is unchanged."""
    src = tiny_files.build(tmp_path / "in",
                           {"model.safetensors": WEIGHTS + tiny_files.scale_names()}, index=True)
    before = tiny_files.digests(src)
    out = tmp_path / "view"
    out.mkdir()
    dropped = weights.write_without_kv_scales(src, out)
    assert dropped == sorted(tiny_files.scale_names())
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == WEIGHTS
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert (out / "tokenizer.json").is_symlink()
    assert tiny_files.digests(src) == before


@pytest.mark.parametrize("text, message", [("{", "config.json is not valid JSON"),
                                           ("[]", "config.json is not a model config")])
def test_scale_free_view_of_a_malformed_config_is_one_error(text, message, tmp_path):
    src = tiny_files.build(tmp_path / "in", {"model.safetensors": WEIGHTS})
    (src / "config.json").write_text(text)
    out = tmp_path / "view"
    out.mkdir()
    with pytest.raises(CheckpointError, match=message):
        weights.write_without_kv_scales(src, out)
