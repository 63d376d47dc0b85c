"""The simulated cache's number formats, against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from kvcalib.kvcache.simulate import clipped, fake_quantize, kivi_keys, kivi_values


def fq(values, scale=1.0, fmt="e4m3", rounding="nearest"):
    x = torch.tensor(values, dtype=torch.float32).reshape(1, -1, 1, 1)
    return fake_quantize(x, scale, fmt, rounding).flatten().tolist()


def test_e4m3_known_values():
    # 0.3 = 1.2 * 2^-2; E4M3 steps there are 2^-5: neighbours 0.28125 and 0.3125.
    assert fq([0.3, -0.3, 1.5, 448.0, 0.015625]) == [0.3125, -0.3125, 1.5, 448.0, 0.015625]
    assert fq([0.3, -0.3], rounding="toward_zero") == [0.28125, -0.28125]
    # Subnormals: the smallest is 2^-9 = 0.001953125; 0.001 rounds up, or to zero.
    assert fq([0.001]) == [0.001953125]
    assert fq([0.001], rounding="toward_zero") == [0.0]


def test_clipping_at_448_and_scaling():
    assert fq([500.0, -1000.0, 447.0]) == [448.0, -448.0, 448.0]  # 447 rounds to 448
    assert fq([1000.0, 3.0], scale=2.0) == [896.0, 3.0]
    x = torch.tensor([500.0, 10.0, -449.0, 0.0]).reshape(1, -1, 1, 1)
    assert clipped(x, 1.0) == (2, 4)
    assert clipped(x, 2.0) == (0, 4)


def test_per_head_scales():
    # 0.3 at scale 1 rounds to 0.3125; at scale 0.1 it is 3.0, exact in E4M3.
    x = torch.tensor([0.3, 0.3]).reshape(1, 2, 1, 1)
    out = fake_quantize(x, torch.tensor([1.0, 0.1]))
    assert out.flatten().tolist() == [0.3125, pytest.approx(0.3, rel=1e-6)]


def test_e5m2():
    # E5M2 steps near 0.3 are 2^-4: neighbours 0.25 and 0.3125; max 57344.
    assert fq([0.3, 60000.0, -1e6], fmt="e5m2") == [0.3125, 57344.0, -57344.0]
    assert fq([0.3], fmt="e5m2", rounding="toward_zero") == [0.25]


def test_toward_zero_never_grows_and_matches_a_brute_force_search():
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()]
    x = torch.linspace(-460, 460, 20011)
    out = torch.tensor(fq(x.tolist(), rounding="toward_zero"))
    assert bool((out.abs() <= x.abs().clamp(max=448)).all())
    # The largest FP8 value not above |x|, with x's sign.
    below = (grid.abs().unsqueeze(0) <= x.abs().clamp(max=448).unsqueeze(1))
    best = torch.where(below, grid.abs().unsqueeze(0), torch.tensor(-1.0)).amax(1)
    assert torch.equal(out, best * x.sign())


def test_kivi_two_bit_groups():
    # Keys: per channel, groups of 2 tokens; min/max over the group; 3 steps.
    k = torch.tensor([[0.0, 10.0], [3.0, 13.0], [1.0, 0.0], [1.4, 0.0], [7.0, 7.0]])
    out = kivi_keys(k.reshape(1, 1, 5, 2), group=2).reshape(5, 2)
    assert out[:2].tolist() == [[0.0, 10.0], [3.0, 13.0]]  # min and max are exact
    assert out[2:4, 0].tolist() == pytest.approx([1.0, 1.4])  # step 0.4/3: exact ends
    assert out[4].tolist() == [7.0, 7.0]  # the unfinished group stays exact
    # Values: per token, groups of 4 channels: [0, 0.4, 1.4, 3] -> step 1 -> [0, 0, 1, 3].
    v = torch.tensor([0.0, 0.4, 1.4, 3.0]).reshape(1, 1, 1, 4)
    assert kivi_values(v, group=4).flatten().tolist() == [0.0, 0.0, 1.0, 3.0]
