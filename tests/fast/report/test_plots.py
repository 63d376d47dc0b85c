"""The sensitivity figure marks the layers whose effect is within noise."""

from __future__ import annotations

from kvcalib.report import plots


def test_noise_layers_are_hatched_and_named(tmp_path):
    bars = {"KL, only this layer FP8": [0.1, 0.2, 0.3, 0.4]}
    marked = plots.sensitivity(tmp_path / "noise.svg", [0, 1, 2, 3], bars, {}, "t",
                               noise=[1, 3]).read_text()
    plain = plots.sensitivity(tmp_path / "plain.svg", [0, 1, 2, 3], bars, {}, "t").read_text()
    assert "within noise" in marked and "within noise" not in plain
    # matplotlib writes one hatch pattern per hatched patch style and fills with it.
    assert "<pattern" in marked and "<pattern" not in plain
    assert marked.count("url(#h") >= 2
