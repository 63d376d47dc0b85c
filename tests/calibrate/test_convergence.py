"""Convergence: the running absmax of every scale, sample after sample.

kvcalib's numbers are checked against running maxima recomputed here from plain
transformers forward passes over the same samples, in the report's order.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import builtin
from kvcalib.calibrate import ScaleOptions, calibrate
from kvcalib.calibrate.convergence import scale_convergence
from kvcalib.report.plots import convergence_plot
from reference import kv_absmax_per_sample, sample_token_ids

SAMPLES = 8


def test_a_known_sequence():
    result = scale_convergence(np.array([1.0, 3.0, 2.0, 5.0, 4.0, 5.0]))
    # running max 1, 3, 3, 5, 5, 5: rises at samples 1, 2 and 4; 3 after the first half
    assert result == {"steps": [[1, 1.0], [2, 3.0], [4, 5.0]], "reached_at": 4,
                      "last_half_growth": pytest.approx(5 / 3 - 1)}
    assert scale_convergence(np.array([2.0]))["last_half_growth"] is None


@pytest.fixture(scope="module")
def calibrated(demo_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("convergence") / "ckpt"
    return calibrate(demo_model, out, scales=ScaleOptions(strategy="attn_head"),
                     samples=builtin(SAMPLES, 64), log=lambda _: None)


def _expected(values: list[float]) -> tuple[list[list[float]], float]:
    """Steps of the running max (1-based sample, value) and growth over the last half."""
    steps, running, at_half = [], 0.0, None
    for sample, value in enumerate(values, start=1):
        if value > running:
            running = value
            steps.append([sample, value])
        if sample == len(values) // 2:
            at_half = running
    return steps, running / at_half - 1


def test_running_absmax_matches_a_plain_forward(calibrated, demo_model):
    report = calibrated.report.model_dump(mode="json")
    assert report["samples"]["used"] == SAMPLES
    # The report's rows, re-tokenized, in the order kvcalib fed them.
    reference = kv_absmax_per_sample(demo_model, sample_token_ids(calibrated.output),
                                     report["compute"]["dtype"])
    flagged = set()
    for layer in report["layers"]:
        for kind in ("k", "v"):
            scales = layer[f"{kind}_convergence"]
            assert len(scales) == 3  # SmolLM2's KV heads
            for head, scale in enumerate(scales):
                values = [float(sample[(layer["layer"], kind)][head]) for sample in reference]
                steps, growth = _expected(values)
                assert [s for s, _ in scale["steps"]] == [s for s, _ in steps], (layer, kind)
                np.testing.assert_allclose([v for _, v in scale["steps"]],
                                           [v for _, v in steps], rtol=1e-6)
                assert scale["reached_at"] == steps[-1][0]
                assert scale["last_half_growth"] == pytest.approx(growth, abs=1e-6)
                if growth > 0.05:
                    flagged.add((layer["layer"], kind))
    found = report["convergence"]["flagged"]
    assert {(f["layer"], f["kind"]) for f in found} == flagged
    assert flagged, "8 samples of real text: some scale should still grow late"
    assert report["convergence"]["note"] == "more samples may raise this scale"


def test_plot(calibrated, tmp_path):
    path = convergence_plot(calibrated.report, tmp_path / "convergence.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
