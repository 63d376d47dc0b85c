"""`run` refuses a model whose weights are not all there, before loading it (issue 20 §3).

transformers fills missing weights at random, so such a model once calibrated to scales
of noise (K absmax 1.7-2.2 where the real layers give 13.9-17.8) and exited 0. The
refusal uses verify's check (kvcalib.checkpoint.expected), names the tensors, exits 2
and comes before "Loading".
"""

from __future__ import annotations

import json
import shutil

import peers
from conftest import kvcalib_run


def _copy_without(src, dst, drop: str) -> None:
    """`src` with every tensor whose name contains `drop` removed (bytes of the rest kept,
    read and written by hand)."""
    shutil.copytree(src, dst)
    tensors = peers.raw_tensors(src / "model.safetensors")
    peers._write(dst / "model.safetensors", [(name, dtype, shape, raw) for name,
                                             (dtype, shape, raw) in sorted(tensors.items())
                                             if drop not in name])


def test_run_refuses_a_layer_without_weights(tiny_model, tmp_path):
    model = tiny_model("llama")
    _copy_without(model, tmp_path / "m", ".layers.3.")
    result = kvcalib_run(tmp_path / "m", tmp_path / "out")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "Loading" not in result.stderr
    assert "1 missing: every weight of layers 3" in result.stderr  # the last layer: a count
    assert not (tmp_path / "out").exists()


def test_run_refuses_an_unexpected_weight(tiny_model, tmp_path):
    """An extra layer the config does not declare is left out by transformers."""
    model = tiny_model("llama")
    shutil.copytree(model, tmp_path / "m")
    tensors = peers.raw_tensors(model / "model.safetensors")
    extra = {name.replace(".layers.3.", ".layers.4."): value
             for name, value in tensors.items() if ".layers.3." in name}
    peers._write(tmp_path / "m" / "model.safetensors",
                 [(n, d, s, r) for n, (d, s, r) in sorted({**tensors, **extra}.items())])
    result = kvcalib_run(tmp_path / "m", tmp_path / "out")
    assert result.returncode == 2, result.stderr
    assert "unexpected" in result.stderr and "model.layers.4." in result.stderr


def test_run_refuses_an_index_pointing_at_an_empty_shard(tiny_model, tmp_path):
    model = tiny_model("llama")
    (tmp_path / "m").mkdir()
    for item in model.iterdir():
        if item.suffix != ".safetensors":
            shutil.copyfile(item, tmp_path / "m" / item.name)
    names = peers.raw_tensors(model / "model.safetensors")
    peers._write(tmp_path / "m" / "model-00001-of-00001.safetensors", [])
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(names, "model-00001-of-00001.safetensors")}))
    result = kvcalib_run(tmp_path / "m", tmp_path / "out")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "Loading" not in result.stderr
    assert "model.embed_tokens.weight" in result.stderr
