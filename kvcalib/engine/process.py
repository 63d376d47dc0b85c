"""Starting a script in the serving environment and ending every process it leaves.

A probe (kvcalib/engine/scripts/) runs in the serving interpreter, reads its request from a
JSON file and writes its answer to another (scripts/protocol.py); everything it and vLLM's
processes print is the engine log.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvcalib.checkpoint.calibration_report import Record
from kvcalib.engine.answers import ProbeAnswer, load_probe_answer
from kvcalib.engine.log import LogFacts, parse_log

SCRIPTS = Path(__file__).resolve().parent / "scripts"
PROBE = SCRIPTS / "vllm_probe.py"


@dataclass
class ProbeRun:
    """One engine start: the probe's JSON result, the log and where it was saved."""

    kv_cache_dtype: str
    result: dict[str, Any]
    log_path: Path
    facts: LogFacts
    seconds: float
    timed_out: bool = False

    @property
    def started(self) -> bool:
        return bool(self.result.get("started"))


GRACE_SECONDS = 10  # between SIGTERM and SIGKILL when ending the probe's processes


def log_folder(command: str, checkpoint: Path) -> Path:
    """Where a command keeps vLLM's logs unless told: ./kvcalib-COMMAND-logs/NAME."""
    return Path(f"kvcalib-{command}-logs") / Path(checkpoint).resolve().name


@dataclass(frozen=True)
class ProbeRequest:
    """What one engine start is asked: the probe's REQUEST.json. `prompts` (texts or
    token-id lists) are scored, each with `max_tokens` greedy tokens."""

    model: Path
    kv_cache_dtype: str
    max_model_len: int | None = None
    skip_layers: list[str] = field(default_factory=list)
    prompts: list[Any] = field(default_factory=list)
    max_tokens: int = 16


def run_probe(python: str, ask: Any, log_path: Path, timeout: float = 1200,
              script: Path = PROBE, answer: type[Record] = ProbeAnswer) -> ProbeRun:
    """Start vLLM once in the serving interpreter; save the whole log to `log_path`.
    `script` (a probe beside PROBE) gets `ask`, a dataclass with `model` and
    `kv_cache_dtype` (a ProbeRequest for PROBE), and answers as `answer` says.

    The probe runs in a session of its own, and every process of it (vLLM's model
    registry subprocess; with VLLM_ENABLE_V1_MULTIPROCESSING=1, its EngineCore, workers and
    resource tracker) is ended when it returns, times out, or this process is
    interrupted or fails.
    """
    # Absolute: the probe runs in a scratch folder, and vLLM takes a path it cannot find
    # for a hub id.
    request = {**asdict(ask), "model": str(Path(ask.model).resolve())}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    timed_out = False
    with tempfile.TemporaryDirectory(prefix="kvcalib-probe-") as tmp, open(log_path, "w") as log:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        # Unbuffered, so that every line lands in the log before the probe's answer line
        # when it was printed before it.
        process = subprocess.Popen([python, str(script), str(request_path), str(result_path)],
                                   stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
                                   start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            end_process_group(process)
        answered = result_path.exists()  # counts even when shutting down took too long
        timed_out = timed_out and not answered
        if answered:
            result = load_probe_answer(result_path.read_text(), answer)
        elif timed_out:
            result = {"started": False,
                      "error": f"vLLM did not answer within {timeout:g} s (--timeout)"}
        else:
            result = {"started": False, "error": "the probe exited with code "
                      f"{process.returncode} without an answer"}
    text = log_path.read_text(errors="replace")
    return ProbeRun(ask.kv_cache_dtype, result, log_path, parse_log(text),
                    round(time.perf_counter() - started, 1), timed_out)


def end_process_group(process: subprocess.Popen, grace: float = GRACE_SECONDS) -> None:
    """End every live process of the group `process` leads: SIGTERM, and SIGKILL for what is
    left after `grace` seconds, or at once on a second Ctrl-C."""
    try:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            deadline = time.monotonic() + grace
            if not group_members(process.pid):
                break
            _signal_group(process.pid, sig)
            while group_members(process.pid) and time.monotonic() < deadline:
                process.poll()  # reap the probe itself
                time.sleep(0.1)
    except KeyboardInterrupt:
        _signal_group(process.pid, signal.SIGKILL)
        raise
    finally:
        process.poll()


def _signal_group(group: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # every member exited meanwhile
        os.killpg(group, sig)


def group_members(group: int) -> list[int]:
    """The live processes of a process group. Zombies do not count: they have exited and
    wait for a parent to reap them (some containers' init never does)."""
    if not Path("/proc/self/stat").exists():  # not Linux: ask whether any process is left
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return []
        return [group]
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        state, _, pgrp = stat[stat.rindex(")") + 2:].split()[:3]  # after "pid (comm) "
        if state != "Z" and int(pgrp) == group:
            members.append(int(entry.name))
    return members
