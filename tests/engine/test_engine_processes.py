"""No engine process outlives `verify`: interrupted, timed out or finished.

The probe runs in a process group of its own (with vLLM's multi-process engine, its
EngineCore, worker and multiprocessing resource tracker join it). Each test watches that
group from outside, by PID through /proc, and checks afterwards that every process it saw
is gone. A zombie counts as gone: it has exited and only waits for a parent to reap it
(this machine's init never does).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import KVCALIB, ctrl_c_reaches_it
from kvcalib.engine.process import end_process_group

# The probe runs vLLM's engine core in its own process by default; these tests ask for
# vLLM's multi-process engine, the widest tree to end (EngineCore, its worker, a tracker).
MULTIPROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _pgid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[2])


def _group(pgid: int) -> set[int]:
    return {int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and _pgid(int(p.name)) == pgid and _alive(int(p.name))}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def _probe_of(process: subprocess.Popen) -> int:
    """The PID of the vLLM probe `kvcalib verify` started (its child), once it runs."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and "vllm_probe.py" in _cmdline(int(entry.name)):
                stat = (entry / "stat").read_text()
                if int(stat[stat.rindex(")") + 2:].split()[1]) == process.pid:
                    return int(entry.name)
        time.sleep(0.2)
    raise AssertionError("verify never started the probe")


def _watch(process: subprocess.Popen, group: int, until: Callable[[set[int]], bool],
           limit: float) -> set[int]:
    """Every live PID of the group seen until `until(seen)` or until `process` exits."""
    seen: set[int] = set()
    deadline = time.monotonic() + limit
    while process.poll() is None and time.monotonic() < deadline:
        seen |= _group(group)
        if until(seen):
            break
        time.sleep(0.2)
    return seen


def _verify(model: Path, out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([str(KVCALIB), "verify", str(model), "--json", str(out / "v.json"),
                             "--kv-cache-dtype", "bfloat16", "--max-model-len", "2048", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=ctrl_c_reaches_it, env=os.environ | MULTIPROCESS)


def _engine_core(pids: set[int]) -> bool:
    return any("EngineCore" in _cmdline(pid) for pid in pids)


@pytest.mark.engine
def test_ctrl_c_during_engine_start_ends_every_engine_process(demo_model, tmp_path):
    process = _verify(demo_model, tmp_path)
    probe = _probe_of(process)
    seen = _watch(process, probe, _engine_core, limit=300)
    assert _engine_core(seen), "vLLM's EngineCore never started"
    process.send_signal(signal.SIGINT)
    process.communicate(timeout=120)
    assert process.returncode == 130
    assert len(seen) >= 3  # probe, EngineCore, resource tracker or worker
    assert [pid for pid in seen | _group(probe) if _alive(pid)] == []


@pytest.mark.engine
def test_timeout_ends_every_engine_process_even_stopped_ones(demo_model, tmp_path):
    """Every process the probe starts is stopped (SIGSTOP) as soon as it appears, so the
    engine cannot start: the timeout must expire, and stopped processes ignore SIGTERM,
    so ending them needs the SIGKILL that follows."""
    process = _verify(demo_model, tmp_path, "--timeout", "30")
    probe = _probe_of(process)
    stopped: set[int] = set()

    def stop_new(pids: set[int]) -> bool:
        for pid in pids - stopped - {probe}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
            stopped.add(pid)
        return False

    seen = _watch(process, probe, stop_new, limit=600)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 1, out + err  # the plain model has no KV scheme
    assert stopped, "the probe started no process before the timeout"
    assert [pid for pid in seen | _group(probe) if _alive(pid)] == []
    report = json.loads((tmp_path / "v.json").read_text())
    (engine,) = [c for c in report["checks"] if c["group"] == "engine"]
    assert engine["status"] == "error"
    assert engine["message"] == "cannot check: vLLM did not answer within 30 s (--timeout)"


def test_ending_a_group_kills_what_ignores_sigterm(tmp_path):
    """A real process tree: a leader, a child that ignores SIGTERM, a grandchild."""
    script = ("import signal, subprocess, sys, time\n"
              "subprocess.Popen([sys.executable, '-c', 'import signal, subprocess, sys, time;"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN);"
              "subprocess.Popen([\"sleep\", \"600\"]); time.sleep(600)'])\n"
              "time.sleep(600)\n")
    leader = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 30
    while len(_group(leader.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    members = _group(leader.pid)
    assert len(members) == 3
    started = time.monotonic()
    end_process_group(leader, grace=2)
    assert [pid for pid in members if _alive(pid)] == []
    assert leader.returncode == -signal.SIGTERM  # reaped, ended by the first signal
    assert 2 <= time.monotonic() - started < 10  # the SIGKILL came after the grace period
