"""--weights: copy, copy-on-write clone or hard link; the output stays a normal folder.

The byte bound is measured on scripts/bench_verify.py's 70B-shaped checkpoint (sparse
files, ~141 GB declared) with /proc/self/io. Reflinks need a filesystem that clones
(XFS, btrfs...): where the test's folder cannot, `reflink` must be refused up front and
`auto` must copy.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import ROOT, builtin, run_kvcalib, tree_digest
from kvcalib.calibrate import WriteOptions, calibrate
from kvcalib.checkpoint import open_checkpoint, open_model, write_checkpoint
from kvcalib.checkpoint import write as weights
from kvcalib.checkpoint.safetensors import raw, weight_files
from kvcalib.errors import UsageError
from kvcalib.reads import load_config
from kvcalib.writes import atomic_output_dir

SCRIPT = ROOT / "scripts" / "bench_verify.py"


def _io(field: str) -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/io")


def _can_clone(folder: Path, source: Path) -> bool:
    try:
        weights.choose_placement("reflink", [source], folder)
    except UsageError as exc:
        assert "cannot clone" in str(exc)
        assert weights.choose_placement("auto", [source], folder)[0] == "copy"
        return False
    return True


@pytest.fixture(scope="module")
def llama_70b(tmp_path_factory) -> Path:
    spec = importlib.util.spec_from_file_location("bench_verify", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    folder = tmp_path_factory.mktemp("weights") / "llama-70b-shaped"
    assert bench.build(folder) > 140e9
    return folder


@pytest.mark.parametrize("mode", ["link", "reflink"])
def test_output_step_writes_under_one_megabyte(mode, llama_70b, tmp_path):
    files = [llama_70b / name for name in weight_files(llama_70b)]
    if mode == "reflink" and not _can_clone(tmp_path, files[-1]):
        return  # refused up front, as asserted in _can_clone
    quant = load_config(llama_70b)["quantization_config"]
    scales = {f"model.layers.{i}.self_attn.{kind}_scale": raw(torch.full((8, 1, 1), 0.01,
                                                                          dtype=torch.bfloat16))
              for i in range(80) for kind in "kv"}
    before = {f: f.stat() for f in files}
    stored, passed = _io("write_bytes"), _io("wchar")
    with atomic_output_dir(tmp_path / "out") as tmp:
        write_checkpoint(tmp, open_model(llama_70b), scales, quant, weights=mode)
    assert _io("write_bytes") - stored < 1_000_000
    if mode == "link":  # a clone's ioctl passes no bytes either; links pass none at all
        assert _io("wchar") - passed < 1_000_000
    out = tmp_path / "out"
    _, checks = open_checkpoint(out)
    assert [c for c in checks if c.status != "pass"] == []
    for src in files:
        if src.name == "kv_scales.safetensors":  # the input's scales: rewritten
            continue
        dst = out / src.name
        assert dst.is_file() and not dst.is_symlink()
        assert os.path.samefile(src, dst) == (mode == "link")
        assert dst.stat().st_size == src.stat().st_size
    for f, stat in before.items():  # the input is untouched
        assert (f.stat().st_mode, f.stat().st_mtime_ns, f.stat().st_size) == (
            stat.st_mode, stat.st_mtime_ns, stat.st_size)


def test_linked_checkpoint_is_a_normal_folder(tiny_model, tmp_path):
    model = Path(shutil.copytree(tiny_model("llama"), tmp_path / "model"))
    source = model / "model.safetensors"
    source.chmod(0o444)  # a read-only input keeps its mode (the link shares it)
    before = tree_digest(model)
    result = calibrate(model, tmp_path / "out", samples=builtin(2, 16),
                       writing=WriteOptions(weights="link"), log=lambda _: None)
    assert result.report.weights.used == "link"
    assert "editing the input files in place" in result.report.weights.reason
    shard = result.output / "model-00001-of-00001.safetensors"
    assert os.path.samefile(source, shard) and not shard.is_symlink()
    assert tree_digest(model) == before
    moved = Path(shutil.move(result.output, tmp_path / "moved"))
    assert (moved / shard.name).read_bytes() == source.read_bytes()
    verified = run_kvcalib("verify", moved, "--static-only")
    assert verified.returncode == 0, verified.stdout


def test_reflink_is_refused_up_front_where_it_cannot_clone(tiny_model, tmp_path):
    model = tiny_model("llama")
    result = run_kvcalib("run", "--model", model, "--output", tmp_path / "out", "--dataset",
                         "builtin", "--num-samples", 2, "--max-seq-len", 16, "--weights",
                         "reflink")
    if _can_clone(tmp_path, model / "model.safetensors"):
        assert result.returncode == 0, result.stderr
        assert not os.path.samefile(model / "model.safetensors",
                                    tmp_path / "out" / "model-00001-of-00001.safetensors")
        return
    assert result.returncode == 2
    assert "Error: --weights reflink: cannot clone model.safetensors" in result.stderr
    assert "Loading" not in result.stderr and not (tmp_path / "out").exists()


def test_link_across_filesystems_and_unknown_modes_are_refused(tiny_model, tmp_path):
    model = tiny_model("llama")
    result = run_kvcalib("run", "--model", model, "--output", tmp_path / "out", "--weights",
                         "hardlink")
    assert result.returncode == 2
    assert ("Error: Invalid value for '--weights': Value error, 'hardlink' is not one of "
            "'auto', 'copy', 'link', 'reflink'" in result.stderr)
    other = Path("/dev/shm")
    if other.is_dir() and os.stat(other).st_dev != os.stat(model).st_dev:
        with pytest.raises(UsageError, match="hard links cannot cross filesystems"):
            weights.choose_placement("link", [model / "model.safetensors"], other)
    else:  # no second filesystem here: a link on the same one is accepted
        chosen = weights.choose_placement("link", [model / "model.safetensors"], tmp_path)
        assert chosen[0] == "link"
