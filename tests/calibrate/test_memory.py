"""Will the model fit? The pipeline is chosen, or the model refused, before loading.

The decisions are exercised with stated byte counts (this machine has no GPU), and end to
end on a tiny model with KVCALIB_DEVICE_MEMORY standing for a small device.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

import pytest
from safetensors import safe_open

from conftest import builtin, run_kvcalib
from kvcalib.calibrate import calibrate, memory
from kvcalib.checkpoint import open_model
from kvcalib.errors import UsageError

GiB = 2**30


def test_estimate_counts_every_weight_in_the_compute_dtype(tiny_model):
    model = tiny_model("llama")
    need = memory.need(open_model(model), "float32", max_seq_len=64, samples=3)
    per_layer, total = defaultdict(int), 0
    with safe_open(model / "model.safetensors", "pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            count = math.prod(f.get_slice(name).get_shape())
            total += 4 * count  # stored bf16, computed in float32
            if name.startswith("model.layers."):
                per_layer[int(name.split(".")[2])] += 4 * count
    assert need.weights == total
    assert need.largest_layer == max(per_layer.values())
    assert need.activations > 0 and need.cache > 0


NEED = memory.Need(weights=10 * GiB, largest_layer=GiB, activations=GiB, cache=GiB)


def test_a_gpu_that_holds_the_model_runs_basic():
    chosen = memory.plan("auto", NEED, memory.Free(device=80 * GiB, host=64 * GiB), "cuda:0")
    assert chosen.pipeline == "basic" and chosen.reason.startswith("fits")


def test_auto_chooses_sequential_when_the_model_does_not_fit_the_gpu():
    chosen = memory.plan("auto", NEED, memory.Free(device=8 * GiB, host=64 * GiB), "cuda:0")
    assert chosen.pipeline == "sequential"
    assert "onloading one layer at a time" in chosen.reason
    assert chosen.needed < 3 * GiB  # one layer and one sample's activations, not the model


@pytest.mark.parametrize("free, message", [
    (memory.Free(device=2 * GiB, host=64 * GiB),
     "sequential needs ~2.50 GiB (2,684,354,560 bytes) of cuda:0 memory, which has 2.00 GiB "
     "(2,147,483,648 bytes) free"),
    (memory.Free(device=8 * GiB, host=8 * GiB),
     "sequential needs ~11.50 GiB (12,348,030,976 bytes) of host memory, which has 8.00 GiB "
     "(8,589,934,592 bytes) free"),
])
def test_a_model_that_cannot_fit_is_refused_with_bytes(free, message):
    with pytest.raises(UsageError, match="the model does not fit") as error:
        memory.plan("auto", NEED, free, "cuda:0")
    assert message in str(error.value)
    assert "Nothing was loaded" in str(error.value)


def test_on_a_cpu_sequential_saves_nothing():
    """The weights sit in host memory in both pipelines; auto never picks sequential."""
    with pytest.raises(UsageError, match=r"basic needs ~11\.50 GiB"):
        memory.plan("auto", NEED, memory.Free(device=8 * GiB, host=8 * GiB), "cpu")
    assert memory.plan("sequential", NEED, memory.Free(device=64 * GiB, host=64 * GiB),
                       "cpu").pipeline == "sequential"


def test_refused_before_loading_through_the_cli(tiny_model, tmp_path):
    result = run_kvcalib("run", "--model", tiny_model("llama"), "--output", tmp_path / "out",
                         "--dataset", "builtin", "--num-samples", 2, "--max-seq-len", 16,
                         env={**os.environ, "KVCALIB_DEVICE_MEMORY": "64MiB"})
    assert result.returncode == 2, result.stderr
    assert "Error: the model does not fit: basic needs ~" in result.stderr
    assert "of host memory, which has 64.00 MiB (67,108,864 bytes) free" in result.stderr
    assert "Loading" not in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_the_cap_is_what_kvcalib_plans_with(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCALIB_DEVICE_MEMORY", "2GiB")
    report = calibrate(tiny_model("llama"), tmp_path / "out", samples=builtin(2, 16),
                       log=lambda _: None).report
    assert report.memory.free == 2 * GiB and report.memory.capped
    assert report.pipeline.used == "basic"
    assert report.pipeline.reason.startswith("fits: needs ~")
