"""Option choices: listed by --help, refused while parsing, checked for Python callers;
and the README layout that names every module."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from conftest import KVCALIB, ROOT
from kvcalib import choices
from kvcalib.calibrate import ComputeOptions, SampleOptions, ScaleOptions, WriteOptions
from kvcalib.checkpoint import layouts
from kvcalib.cli import app
from kvcalib.errors import UsageError
from kvcalib.evaluate.options import Formats, Gates, HeldOut, LayerSweep, Passkey, SimulationOptions
from kvcalib.kvcache.capacity import EstimateOptions, Kivi
from kvcalib.verify.options import EngineOptions

# What the README documents for each choice option, written out by hand.
DOCUMENTED = {
    ("run", "--strategy"): "tensor|attn_head",
    ("run", "--observer"): "static_minmax|minmax|mse",
    ("run", "--pipeline"): "auto|basic|sequential",
    ("run", "--dtype"): "auto|bfloat16|float16|float32",
    ("run", "--attention"): "eager|sdpa",
    ("run", "--weights"): "auto|copy|link|reflink",
    ("eval", "--rounding"): "nearest|toward_zero",
    ("eval", "--dtype"): "float32|bfloat16|float16",
    ("convert", "--to"): "compressed-tensors|modelopt|quark",
}


@pytest.mark.parametrize("command", sorted({command for command, _ in DOCUMENTED}))
def test_help_lists_every_choice(command):
    help_text = subprocess.run([str(KVCALIB), command, "--help"], capture_output=True,
                               text=True, env={**os.environ, "COLUMNS": "300"}).stdout
    for (listed_by, option), allowed in DOCUMENTED.items():
        if listed_by == command:
            line = next(line for line in help_text.splitlines() if f" {option} " in line)
            assert f"<{allowed}>" in line, line


def test_python_callers_get_the_same_checks():
    """The option groups check themselves once, when built: Python callers get the CLI's
    choices and bounds."""
    for group, option, bad in ((ScaleOptions, "strategy", "channel"),
                               (ScaleOptions, "observer", "avg"),
                               (ComputeOptions, "pipeline", "fast"),
                               (ComputeOptions, "dtype", "int8"),
                               (WriteOptions, "weights", "hardlink")):
        group()  # the defaults are valid
        with pytest.raises(UsageError, match=f"unknown .*'{bad}'; choose one of "):
            group(**{option: bad})
    with pytest.raises(UsageError, match="unknown attention 'flash'; choose one of eager, sdpa"):
        ComputeOptions(attention="flash")
    with pytest.raises(UsageError, match="--attention sdpa needs the basic pipeline"):
        ComputeOptions(pipeline="sequential", attention="sdpa")
    with pytest.raises(UsageError, match="--num-samples must be at least 1, got 0"):
        SampleOptions(num_samples=0)


@pytest.mark.parametrize(("group", "values", "message"), [
    (HeldOut, {"batch_size": 0}, "--batch-size must be at least 1, got 0"),
    (SimulationOptions, {"rounding": "up"}, "unknown rounding 'up'; choose one of nearest, "),
    (Formats, {"names": ["fp8"], "block_size": 0}, "--block-size must be at least 1, got 0"),
    (Passkey, {"depths": [0.5, 1.5]}, "--passkey-depths must be at most 1, got 1.5"),
    (LayerSweep, {"samples": 1}, "--sweep-samples must be at least 2, got 1"),
    (Gates, {"max_kl": -0.1}, "--max-kl must be at least 0, got -0.1"),
    (EngineOptions, {"max_model_len": 0}, "--max-model-len must be at least 1, got 0"),
    (Kivi, {"residual": -1}, "--kivi-residual must be at least 0, got -1"),
    (EstimateOptions, {"context_length": 0}, "--context-length must be at least 1, got 0"),
])
def test_eval_verify_and_estimate_groups_check_their_bounds(group, values, message):
    """eval's, verify's and estimate's groups refuse what their CLI options refuse, when a
    Python caller builds them."""
    group()  # the defaults are valid
    with pytest.raises(UsageError, match=re.escape(message)):
        group(**values)


def test_convert_targets_are_the_layouts_kvcalib_writes():
    assert choices.values(choices.ScaleLayout) == layouts.TARGETS


def test_readme_map_names_every_package_and_docs_every_command():
    """The README's map is how a newcomer finds a package, and docs/ has a page for every
    command: none may be missing."""
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("```")[1]
    packages = sorted(path.parent.name for path in (ROOT / "kvcalib").glob("*/__init__.py"))
    missing = [name for name in packages if f"{name}/" not in layout]
    assert not missing, f"README layout lacks {missing}"
    commands = [c.name for c in app.registered_commands if c.name != "demo-model"]
    assert len(commands) >= 8
    assert [c for c in commands if not (ROOT / "docs" / f"{c}.md").is_file()] == []
