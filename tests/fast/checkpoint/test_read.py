"""kvcalib.checkpoint.read: a checkpoint opened once. Its KvScales hold what the files hold
(read by hand in tests/peers.py, not by kvcalib's reader), it cannot be changed after
opening, and the calibration report is read only by the commands that ask for it."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import peers
from kvcalib.checkpoint import REPORT_FILE, KvScales, Scale, open_checkpoint
from kvcalib.errors import CheckpointError

# Every layout's scale tensor names: compressed-tensors, ModelOpt, Quark.
SCALE_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\."
                        r"(?:(?P<proj>[kvq])_proj\.)?(?:(?P<kind>[kvq])_scale|output_scale)$")


@pytest.mark.parametrize("name", peers.NAMES)
def test_scales_are_what_the_files_hold(name, tmp_path):
    ckpt, checks = open_checkpoint(peers.materialize(name, tmp_path / name))
    expected = {}
    for tensor, value in peers.scales(name).items():
        match = SCALE_NAME.match(tensor)
        assert match, tensor
        expected[(int(match[1]), match["kind"] or match["proj"])] = value
    got = {key: scale.values.tolist() for key, scale in ckpt.scales.items()}
    assert got == {key: [value] for key, value in expected.items()}
    assert ckpt.geometry.attention_layers == list(range(30))
    assert len(ckpt.tensors) == len(peers.manifest(name)["tensors"])
    assert [c.message for c in checks if c.group == "scales" and c.status == "fail"] == []


def test_a_checkpoint_is_frozen_and_its_report_read_when_asked(tmp_path):
    folder = peers.materialize("kvcalib-tensor", tmp_path / "ckpt")
    (folder / REPORT_FILE).write_text('{"schema_version": 1, "layers": "?"}')
    ckpt, checks = open_checkpoint(folder)
    assert [c.group for c in checks if c.status == "fail"] == []  # verify reads no report
    with pytest.raises(CheckpointError, match=f"{REPORT_FILE} is not a kvcalib calibration"):
        _ = ckpt.report
    with pytest.raises(dataclasses.FrozenInstanceError):
        ckpt.scales = KvScales()  # type: ignore[misc]
    (folder / REPORT_FILE).unlink()
    assert open_checkpoint(folder)[0].report is None


def test_a_scale_is_compared_at_its_storage_precision():
    """bf16 keeps 8 significant bits: two readings may differ by 2^-8, never by 2^-7."""
    scale = Scale(np.array([0.01]), "BF16")
    assert np.allclose(0.01 * (1 + 2**-9), scale.values, rtol=scale.rtol)
    assert not np.allclose(0.01 * (1 + 2**-7), scale.values, rtol=scale.rtol)
    assert Scale(np.array([0.01]), "F32").rtol == 1e-6
