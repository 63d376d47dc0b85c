"""Data-parallel calibration: 2 CPU ranks on gloo, launched as users launch them.

The test that matters: two ranks, each on its half of the samples, give byte-identical
scales to one process on all of them (llm-compressor reduces static_minmax with MAX).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from conftest import KVCALIB, run_kvcalib

ARGS = ("--dataset", "builtin", "--num-samples", 6, "--max-seq-len", 128, "--strategy",
        "attn_head")


def _report(ckpt):
    return json.loads((ckpt / "kvcalib_report.json").read_text())


def test_two_ranks_give_the_bytes_of_one_process(smol_attn_head, demo_model, tmp_path):
    out = tmp_path / "two-ranks"
    result = run_kvcalib("run", "--model", demo_model, "--output", out, *ARGS,
                         "--nproc-per-node", 2)
    assert result.returncode == 0, result.stderr
    one = smol_attn_head  # the same options, one process (conftest)
    assert (out / "kv_scales.safetensors").read_bytes() == (
        one / "kv_scales.safetensors").read_bytes()
    two, single = _report(out), _report(one)
    assert two["dataset"]["token_ids_sha256"] == single["dataset"]["token_ids_sha256"]
    assert two["dataset"]["rows_used"] == single["dataset"]["rows_used"]
    rows = single["dataset"]["rows_used"]
    assert two["distributed"] == {"world_size": 2, "backend": "gloo", "ranks": [
        {"rank": 0, "samples": [1, 3], "rows": rows[:3]},
        {"rank": 1, "samples": [4, 6], "rows": rows[3:]}]}
    assert single["distributed"]["world_size"] == 1
    # Each sample's absmax was gathered in order: the convergence report is the same too.
    assert two["layers"] == single["layers"]
    # Rank 0 alone printed the summary and wrote; the other rank wrote nothing anywhere.
    assert result.stdout.count("Checkpoint:") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two-ranks"]


def test_minmax_on_several_ranks_warns(tiny_model, tmp_path):
    result = run_kvcalib("run", "--model", tiny_model("llama"), "--output", tmp_path / "out",
                         "--dataset", "builtin", "--num-samples", 2, "--max-seq-len", 16,
                         "--observer", "minmax", "--nproc-per-node", 2)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("the scales depend on the number of ranks (2)") == 1


@pytest.mark.parametrize("value, message", [
    ("0", "--nproc-per-node must be at least 1, got 0"),
    ("-2", "--nproc-per-node must be at least 1, got -2"),
    (str((os.cpu_count() or 1) + 1),
     f"--nproc-per-node {(os.cpu_count() or 1) + 1}: this machine has only {os.cpu_count()} "
     "CPU cores and no GPU"),
])
def test_bad_process_counts_are_refused_up_front(value, message, tiny_model, tmp_path):
    started = time.monotonic()
    result = run_kvcalib("run", "--model", tiny_model("llama"), "--output", tmp_path / "out",
                         "--nproc-per-node", value)
    assert result.returncode == 2, result.stderr
    assert f"Error: {message}" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()
    assert time.monotonic() - started < 60  # no rank was started


def test_more_ranks_than_samples_and_nested_torchrun_are_refused(tiny_model, tmp_path):
    result = run_kvcalib("run", "--model", tiny_model("llama"), "--output", tmp_path / "out",
                         "--num-samples", 1, "--nproc-per-node", 2)
    assert result.returncode == 2
    assert "Error: 1 samples cannot be shared by 2 ranks" in result.stderr
    result = run_kvcalib("run", "--model", tiny_model("llama"), "--output", tmp_path / "out",
                         "--nproc-per-node", 2, env={**os.environ, "TORCHELASTIC_RUN_ID": "x"})
    assert result.returncode == 2 and "already runs under torchrun" in result.stderr


def _start(command: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, **kwargs)


def _wait_for(process: subprocess.Popen, marker: str) -> list[str]:
    lines = []
    for line in process.stderr:
        lines.append(line)
        if line.startswith(marker):
            return lines
    raise AssertionError(f"{marker!r} never printed; exit {process.wait()}: {''.join(lines)}")


def _long_run(model, out) -> list[str]:
    # --weights copy: writing takes long enough (270 MB, fsynced) to kill a rank meanwhile.
    return ["run", "--model", str(model), "--output", str(out), "--dataset", "builtin",
            "--num-samples", "16", "--max-seq-len", "256", "--weights", "copy"]


def test_killing_a_rank_stops_the_launched_job(demo_model, tmp_path):
    process = _start([str(KVCALIB), *_long_run(demo_model, tmp_path / "out"),
                      "--nproc-per-node", "2"])
    _wait_for(process, "Calibrating")
    ranks = {int(child.environ()["RANK"]): child
             for child in psutil.Process(process.pid).children(recursive=True)
             if "RANK" in child.environ()}
    assert sorted(ranks) == [0, 1]
    killed = time.monotonic()
    ranks[1].send_signal(signal.SIGKILL)
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 1
    _, alive = psutil.wait_procs(list(ranks.values()), timeout=60)
    assert not alive and time.monotonic() - killed < 90
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    # rank 0 may first print its own error (its collective lost rank 1); the last line
    # names the rank that died
    assert errors[-1] == ("Error: rank 1 of 2 was killed by SIGKILL; torchrun stopped the "
                          "other ranks and nothing was written"), stderr[-2000:]
    assert "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_on_the_launcher_stops_every_rank_and_writes_nothing(demo_model, tmp_path):
    """As a terminal sends it: SIGINT to the launcher and its ranks (one process group)."""
    process = _start([str(KVCALIB), *_long_run(demo_model, tmp_path / "out"),
                      "--nproc-per-node", "2"], start_new_session=True)
    _wait_for(process, "Calibrating")
    ranks = [child for child in psutil.Process(process.pid).children(recursive=True)
             if "RANK" in child.environ()]
    os.killpg(process.pid, signal.SIGINT)
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 130, stderr[-2000:]
    _, alive = psutil.wait_procs(ranks, timeout=60)
    assert not alive
    assert "Traceback" not in stderr and "SignalException" not in stderr, stderr[-2000:]
    assert stderr.rstrip().endswith("Interrupted; nothing was written."), stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("killed_at", ["Calibrating", "Writing"])
def test_without_a_launcher_the_surviving_rank_fails_alone(killed_at, demo_model, tmp_path):
    """`torchrun -m kvcalib run` as torchrun starts it, but with no agent to stop the
    others: the rank left alone notices at its next collective and exits non-zero, and
    nothing appears even when it had written everything but its peer was lost."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ranks = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TORCHELASTIC_RUN_ID": "test", "OMP_NUM_THREADS": "1"}
        ranks.append(_start([sys.executable, "-m", "kvcalib",
                             *_long_run(demo_model, tmp_path / "out")], env=env))
    _wait_for(ranks[0], killed_at)
    killed = time.monotonic()
    ranks[1].kill()
    stderr = ranks[0].stderr.read()
    assert ranks[0].wait(timeout=300) == 1, stderr[-3000:]
    assert ranks[1].wait() == -signal.SIGKILL
    assert time.monotonic() - killed < 300
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, stderr[-2000:]
    if killed_at == "Calibrating":
        assert "Connection closed by peer" in errors[0], stderr[-2000:]
    else:  # gloo may also meet the loss as a write to a reset or broken connection
        assert "lost contact with another rank while rank 0 wrote the checkpoint" in errors[0]
        assert re.search(r"Connection (closed|reset) by peer|Broken pipe", errors[0]), errors
    assert "Traceback" not in stderr
    assert list(tmp_path.iterdir()) == []
