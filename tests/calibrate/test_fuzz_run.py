"""`run`, on random input layouts and random outputs, with every `--weights` mode (issue 20 §8).

Hypothesis redistributes a real tiny Llama's tensors over files whose names the output
also uses (model.safetensors alone or beside shards such as
model-00001-of-00001.safetensors; kv_scales.safetensors), with an index or not, as plain
files or as the Hugging Face cache's links to blobs, sometimes with the old KV scales of
an earlier calibration and sometimes without one tensor. It draws `--weights` (copy,
link, reflink, auto) and the output (tiny_files.OUTPUTS).
`calibrate` runs for real, in process, on two 16-token samples.

The property, for any draw: every input file keeps its sha256. After success the output
passes static verify, every weight its index names is in the file it names with the
input's bytes, and the scales equal those of a run on the model's own folder (the
weights calibrated were the input's, not transformers' random fill). After a kvcalib
error nothing new is at the output, an existing output is as it was, and no temporary is
left beside it. Any other exception fails the test.
KVCALIB_FUZZ_RUN_EXAMPLES sets the number of examples (CI: 80, about 20 s).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import peers
import tiny_files
from conftest import SCALES, TOKENIZER_FILES, builtin
from kvcalib.calibrate import WriteOptions, calibrate
from kvcalib.errors import UsageError

EXAMPLES = int(os.environ.get("KVCALIB_FUZZ_RUN_EXAMPLES", "80"))
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
          "model-00001-of-00001.safetensors"]
# The names each layout may use: an unsharded model, shards (whose names the output also
# takes), and any mix, with model.safetensors (which transformers prefers to an index).
POOLS = [["model.safetensors"], SHARDS, ["model.safetensors", *SHARDS]]
# Every output of tiny_files.OUTPUTS, those a run may write to three times as often.
KINDS = tiny_files.OUTPUTS + ["fresh", "existing --overwrite",
                              "holds a hard link --overwrite"] * 2
OLD_SCALE = ("BF16", [1], tiny_files.bf16([0.05]))


@dataclass(frozen=True)
class Llama:
    """The tiny Llama, its tensors, and the scales a run on its own folder writes (kept
    out of the repr Hypothesis prints for a failing case)."""

    folder: Path
    tensors: dict = field(repr=False)
    scales: dict = field(repr=False)


@pytest.fixture(scope="module")
def llama(tiny_model, tmp_path_factory) -> Llama:
    folder = tiny_model("llama")
    reference = calibrate(folder, tmp_path_factory.mktemp("fuzz-run") / "out",
                          samples=builtin(2, 16), log=lambda _: None).output
    return Llama(folder, peers.raw_tensors(folder / "model.safetensors"),
                 peers.raw_tensors(reference / SCALES))


@st.composite
def layouts(draw, names: list[str]) -> tuple[dict[str, list[str]], bool, bool]:
    """File name -> tensors it holds (a weight may be in no file, old scales may be in
    some); whether an index names them; whether the config declares the old KV scheme."""
    layers = sorted({n.split(".")[2] for n in names if n.startswith("model.layers.")})
    old_scales = draw(st.booleans())
    scales = [f"model.layers.{i}.self_attn.{kind}_scale" for i in layers for kind in "kv"]
    pool = draw(st.sampled_from(POOLS))
    left_out = draw(st.sampled_from([None] * 3 * len(names) + names))  # a quarter of draws
    placed: dict[str, list[str]] = {}
    for tensor in names:
        if tensor != left_out:
            placed.setdefault(draw(st.sampled_from(pool)), []).append(tensor)
    for tensor in scales if old_scales else []:  # where an earlier calibration put them
        where = draw(st.sampled_from([*pool, "kv_scales.safetensors"]))
        placed.setdefault(where, []).append(tensor)
    index = len(placed) > 1 or draw(st.booleans())
    return placed, index, old_scales


def _build(folder: Path, model: Path, tensors: dict, placed: dict[str, list[str]],
           index: bool, old_scales: bool) -> Path:
    folder.mkdir(parents=True)
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        shutil.copyfile(model / name, folder / name)
    config = json.loads((model / "config.json").read_text())
    if old_scales:
        config["quantization_config"] = tiny_files.KV_SCHEME
    (folder / "config.json").write_text(json.dumps(config))
    for file, held in placed.items():
        peers._write(folder / file, [(t, *tensors.get(t, OLD_SCALE)) for t in sorted(held)])
    if index:
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {t: f for f, held in placed.items() for t in held}}))
    return folder


@settings(max_examples=EXAMPLES, deadline=None,
          derandomize="KVCALIB_FUZZ_RUN_EXAMPLES" not in os.environ,  # CI: the same examples
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), kind=st.sampled_from(KINDS),
       weights=st.sampled_from(["copy", "link", "reflink", "auto"]), cached=st.booleans())
def test_run_never_changes_an_input_and_leaves_all_or_nothing(llama, data, kind, weights,
                                                              cached):
    placed, index, old_scales = data.draw(layouts(sorted(llama.tensors)))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = _build(tiny_files.input_folder(root, cached), llama.folder, llama.tensors,
                     placed, index, old_scales)
        if cached:
            tiny_files.as_cache_links(src)
        out, overwrite = tiny_files.prepare_output(kind, root, src)
        if not tiny_files.all_or_nothing(src, out, lambda: calibrate(
                src, out, samples=builtin(2, 16),
                writing=WriteOptions(weights=weights, overwrite=overwrite),
                log=lambda _: None)):
            return
        event(f"written: {kind}, --weights {weights}")
        # the weights calibrated were the input's, wherever its files put them
        assert peers.raw_tensors(out / SCALES) == llama.scales


def test_run_refuses_weights_that_transformers_would_not_load(llama, tmp_path):
    """transformers reads model.safetensors alone when it exists, and ignores the index:
    with the other layers in shards it would have calibrated random weights."""
    names = sorted(llama.tensors)
    placed = {"model.safetensors": [n for n in names if ".layers.3." not in n],
              "model-00001-of-00001.safetensors": [n for n in names if ".layers.3." in n]}
    src = _build(tmp_path / "src", llama.folder, llama.tensors, placed, True, False)
    with pytest.raises(UsageError, match=r"transformers loads model.safetensors alone .* "
                       r"1 missing: every weight of layers 3"):
        calibrate(src, tmp_path / "out", samples=builtin(2, 16), log=lambda _: None)
    assert not (tmp_path / "out").exists()
