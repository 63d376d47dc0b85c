"""No output option may write into an input (issue 20 §4): `run --json MODEL/config.json`
once replaced the model's config with the report. Every output path is compared with every
input resolved through symbolic links, and by inode for hard links, before any work; the
inputs keep their sha256."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from conftest import builtin, run_kvcalib
from kvcalib.calibrate import calibrate


@pytest.fixture(scope="module")
def tiny_ckpt(tiny_model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-ckpt") / "ckpt"
    calibrate(tiny_model("llama"), out, samples=builtin(2, 16), log=lambda _: None)
    return out


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# (command, the option that points into the input, the name it gives there)
CASES = [
    (["run", "--model", "IN", "--output", "OUT", "--dataset", "builtin"], "--json",
     "config.json"),
    (["run", "--model", "IN", "--output", "OUT", "--dataset", "builtin"], "--plot", "x.png"),
    (["convert", "IN", "--to", "quark", "--output", "OUT"], "--json", "config.json"),
    (["verify", "IN", "--static-only"], "--json", "config.json"),
    (["verify", "IN", "--static-only"], "--junit", "junit.xml"),
    (["verify", "IN"], "--log-dir", "logs"),
    (["eval", "IN"], "--json", "kvcalib_report.json"),
    (["eval", "IN"], "--plot", "x.png"),
    (["eval", "IN", "--formats", "fp8"], "--pareto", "p.png"),
    (["inspect", "IN"], "--json", "config.json"),
    (["inspect", "IN"], "--plot", "x.png"),
    (["estimate", "IN"], "--json", "config.json"),
]


@pytest.mark.parametrize("args, option, name", CASES,
                         ids=[f"{c[0][0]} {c[1]}" for c in CASES])
def test_an_output_inside_the_input_is_refused_before_any_work(args, option, name, tiny_ckpt,
                                                                tmp_path):
    source = tmp_path / "in"
    shutil.copytree(tiny_ckpt, source)
    before = _digests(source)
    out = tmp_path / "out"
    args = [str(source) if a == "IN" else str(out) if a == "OUT" else a for a in args]
    result = run_kvcalib(*args, option, source / name, timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert f"Error: {option} {source / name} is inside the input folder" in result.stderr
    assert _digests(source) == before
    assert not out.exists()


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_an_output_linked_to_an_input_file_is_refused(link, tiny_ckpt, tmp_path):
    source = tmp_path / "in"
    shutil.copytree(tiny_ckpt, source)
    before = _digests(source)
    report = tmp_path / "report.json"
    if link == "symbolic":
        report.symlink_to(source / "config.json")
        said = "is inside the input folder"
    else:
        os.link(source / "config.json", report)
        said = "is a hard link to the input's"
    result = run_kvcalib("verify", source, "--static-only", "--json", report, timeout=120)
    assert result.returncode == 2 and said in result.stderr, result.stderr
    assert _digests(source) == before


@pytest.mark.parametrize("args, label", [(["verify", "."], "the default --log-dir"),
                                         (["eval", ".", "--engine"], "the engine's log folder")])
def test_default_log_folder_inside_the_input_is_refused(args, label, tiny_ckpt, tmp_path):
    """The default log folder, ./kvcalib-COMMAND-logs/NAME, lies inside the checkpoint
    when the command runs from there."""
    source = tmp_path / "in"
    shutil.copytree(tiny_ckpt, source)
    before = _digests(source)
    result = run_kvcalib(*args, cwd=source, timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert f"Error: {label} kvcalib-{args[0]}-logs/in is inside the input folder" \
        in result.stderr, result.stderr
    assert _digests(source) == before
