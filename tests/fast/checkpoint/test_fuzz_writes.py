"""A command that writes a checkpoint, on random inputs and random outputs (issue 20 §8).

Hypothesis draws the input's layout (which file holds each tensor, among names the output
also uses; an index or none; a tensor left out; plain files or the Hugging Face cache's
links to blobs) and the output (fresh, inside the input,
the input itself, existing and not empty with or without --overwrite and holding a hard
link to an input file, under a file, in /proc). `convert` writes it, in process.

The property, for any draw: every input file keeps its sha256; after success the output
passes static verify and every tensor its index names is in the file it names, with the
input's bytes; after a kvcalib error nothing new is at the output, an existing output is
as it was, and no temporary is left beside it. Any other exception fails the test.
KVCALIB_FUZZ_EXAMPLES sets the number of examples (CI: 200, about 10 s).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import tiny_files
from kvcalib.checkpoint.convert import convert

EXAMPLES = int(os.environ.get("KVCALIB_FUZZ_EXAMPLES", "200"))
FILE_NAMES = ["model.safetensors", "model-00001-of-00001.safetensors",
              "model-00001-of-00002.safetensors", "kv_scales.safetensors",
              "weights.safetensors"]
TENSORS = sorted(tiny_files.weight_shapes()) + tiny_files.scale_names()


@st.composite
def inputs(draw) -> tuple[dict[str, list[str]], bool]:
    """File name -> tensors it holds (some tensor may be in no file), and whether an index
    names them."""
    left_out = draw(st.sampled_from([None] * 3 * len(TENSORS) + TENSORS))  # a quarter
    placed: dict[str, list[str]] = {}
    for tensor in TENSORS:
        if tensor != left_out:
            placed.setdefault(draw(st.sampled_from(FILE_NAMES)), []).append(tensor)
    index = len(placed) > 1 or draw(st.booleans())
    return placed, index


@settings(max_examples=EXAMPLES, deadline=None,
          derandomize="KVCALIB_FUZZ_EXAMPLES" not in os.environ,  # CI: the same examples
          suppress_health_check=[HealthCheck.too_slow])
@given(inputs(), st.sampled_from(tiny_files.OUTPUTS), st.sampled_from(["modelopt", "quark"]),
       st.booleans())
def test_writing_never_changes_an_input_and_leaves_all_or_nothing(layout, kind, to, cached):
    placed, index = layout
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        src = tiny_files.build(tiny_files.input_folder(root, cached), placed,
                               index=index)
        if cached:
            tiny_files.as_cache_links(src)
        out, overwrite = tiny_files.prepare_output(kind, root, src)
        if tiny_files.all_or_nothing(src, out, lambda: convert(src, to, out,
                                                               overwrite=overwrite)):
            event(f"written: {kind}")
