"""The one protocol between kvcalib and its probes: the request a probe reads, the answer
it writes, and the line that marks the answer in the log.

Plain Python only. A probe runs as a script in the serving environment, where its folder
is sys.path[0] and this module is imported by name (`import probe_protocol`); kvcalib
imports it as kvcalib.engine.scripts.probe_protocol for the constants.
"""

import json
import os
import sys
import traceback

ANSWERED = "kvcalib-probe: answer written; what follows is vLLM's shutdown"
VLLM_PROBE_SCHEMA = 1  # of vllm_probe.py's answer; kvcalib.engine.answers reads it
LM_EVAL_PROBE_SCHEMA = 1  # of lm_eval_probe.py's answer
SHUTDOWN_TIMEOUT_S = 60  # vLLM's own default (5 s) force-kills a worker still exiting


def read_request(path):
    """The REQUEST.json kvcalib wrote, with vLLM's settings set before vLLM is imported
    (it reads them at import): the CPU KV space asked for, and the engine core in the
    probe's own process unless the caller's environment says otherwise. A probe is vLLM's
    only client, and without the EngineCore process a probe on SmolLM2 took 16-20 s
    instead of 42-46 s on 2 cores (docs/benchmarks.md)."""
    with open(path) as f:
        request = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(request.get("cpu_kv_space_gib", 1)))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return request


def finish(result, path, code):
    """Write `result` to `path` all at once, then print ANSWERED: whatever vLLM prints after
    that line is shutdown and says nothing about the checkpoint. Returns `code`."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)
    sys.stderr.flush()
    print(ANSWERED, flush=True)
    return code


def failed(result, path, exc, code):
    """Answer with `exc` as the error and `code`, its traceback printed into the log first
    (the root cause, for the log's reader)."""
    traceback.print_exc()
    result["error"] = error_text(exc)
    return finish(result, path, code)


def error_text(exc):
    """The exception with every line of its message (pydantic's come on several lines)."""
    return f"{type(exc).__name__}: {exc}"


def shutdown(engine_core):
    """Stop the engine processes now, with time to exit on their own, instead of in a
    finalizer at interpreter exit. A failure here comes after the answer: log it only."""
    try:
        engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    except Exception:
        traceback.print_exc()
