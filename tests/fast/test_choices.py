"""Option choices: listed by --help, refused while parsing, checked for Python callers;
and the README layout that names every module."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import KVCALIB
from kvcalib import calibration, choices, layouts
from kvcalib.errors import UsageError

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
    good = {"strategy": "tensor", "observer": "static_minmax", "pipeline": "auto",
            "dtype": "auto", "weights": "auto", "num_samples": 1, "max_seq_len": 1}
    calibration.check_options(**good)
    for option, bad in (("strategy", "channel"), ("observer", "avg"), ("pipeline", "fast"),
                        ("dtype", "int8"), ("weights", "hardlink")):
        with pytest.raises(UsageError, match=f"unknown .*'{bad}'; choose one of "):
            calibration.check_options(**{**good, option: bad})
    with pytest.raises(UsageError, match="unknown attention 'flash'; choose one of eager, sdpa"):
        calibration.check_options(**good, attention="flash")
    with pytest.raises(UsageError, match="--attention sdpa needs the basic pipeline"):
        calibration.check_options(**{**good, "pipeline": "sequential"}, attention="sdpa")


def test_convert_targets_are_the_layouts_kvcalib_writes():
    assert choices.values(choices.ScaleLayout) == tuple(layouts.SCALE_NAMES)


def test_readme_layout_names_every_module():
    """The README's layout section is how a newcomer finds a module: none may be missing."""
    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("```")[1]
    modules = {path.name for path in (root / "kvcalib").glob("*.py")} - {"__init__.py",
                                                                       "__main__.py"}
    missing = sorted(name for name in modules if name not in layout)
    assert not missing, f"README layout lacks {missing}"
