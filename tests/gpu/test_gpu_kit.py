"""The GPU kit and the GPU check's CPU dry run (docs/gpu.md), as CI runs them: the kit
is built and installed into a scratch Python 3.12 environment, a kit missing a wheel is
caught, and scripts/gpu_check.py --cpu-dry-run passes every step on a tiny shape."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import gpu_kit
import pytest

from conftest import ROOT


@pytest.fixture(scope="module")
def kit(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kit") / "gpu-kit"
    done = subprocess.run([sys.executable, ROOT / "scripts" / "gpu_kit.py", "--kit", folder],
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return folder


def test_the_kit_is_what_the_machine_lacks_and_fits(kit):
    summary = json.loads((kit / "kit.json").read_text())
    names = {gpu_kit.canonical(w["file"].split("-")[0]) for w in summary["wheels"]}
    assert {"kvcalib", "llmcompressor", "compressed-tensors"} <= names
    assert not names & set(gpu_kit.machine())  # nothing the machine already has
    assert summary["unmet"] == []
    assert summary["total_bytes"] <= gpu_kit.CARRY_LIMIT
    assert (kit / "tokenizer" / "tokenizer.json").is_file()


def test_a_kit_missing_a_wheel_is_caught(kit, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(kit, partial, ignore=shutil.ignore_patterns("loguru-*"))
    with tempfile.TemporaryDirectory() as scratch:
        unmet = gpu_kit.check_installed(partial, Path(scratch))
    assert any(line.startswith("llmcompressor needs loguru") for line in unmet), unmet


def test_cpu_dry_run_passes_every_step(tmp_path):
    out = tmp_path / "dry"
    done = subprocess.run([sys.executable, ROOT / "scripts" / "gpu_check.py", "--cpu-dry-run",
                           "--output", out], capture_output=True, text=True, timeout=1500,
                          check=False)
    results = json.loads((out / "gpu_check.json").read_text())
    statuses = {name: step["status"] for name, step in results["steps"].items()}
    assert done.returncode == 0, (statuses, done.stdout[-3000:], done.stderr[-3000:])
    assert set(statuses) == {"model", "speed", "compute_bound", "memory_plan",
                             "fp8_rounding", "nccl"}
    speed = results["steps"]["speed"]
    assert speed["same_scales"] and speed["wall_ratio"][0] > 0
    assert results["steps"]["nccl"]["backend"] == "gloo"
    assert results["steps"]["fp8_rounding"]["agreement"]["nearest"] == 1.0
    assert (out / "gpu_check.md").read_text().startswith("# GPU check (cpu dry run)")
