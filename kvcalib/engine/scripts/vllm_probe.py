"""Start vLLM on a checkpoint, read back its loaded KV scales, optionally score prompts.

Runs in the serving environment, which has vLLM but not kvcalib: this file imports
neither kvcalib nor anything outside vLLM's own dependencies. kvcalib runs it as

    python vllm_probe.py REQUEST.json RESULT.json

and reads its stdout/stderr as the engine log. REQUEST holds: model, kv_cache_dtype,
max_model_len, skip_layers, prompts (texts or token-id lists), max_tokens and
cpu_kv_space_gib. RESULT gets: vllm_version, platform, started, error, start_seconds,
scales (per attention layer: the loaded _k/_v/_q_scale tensors and the floats the
backends use) and outputs (greedy tokens and per-position prompt log-probs).

Once RESULT is written, the probe prints the ANSWERED line and only then shuts the engine
down: whatever vLLM prints after that line is shutdown, and says nothing about the
checkpoint (vLLM's own process cleanup can race and print a traceback there).

Exit codes: 0 ok, 3 vLLM cannot be imported, 4 the engine failed to start, 5 it started
but the scales or outputs could not be read.
"""

import os
import sys
import time

from probe_protocol import VLLM_PROBE_SCHEMA, error_text, failed, finish, read_request, shutdown


def read_scales(model):
    """Runs inside vLLM's worker: every attention layer's loaded scales."""
    scales = {}
    for name, module in model.named_modules():
        if not hasattr(module, "_k_scale"):
            continue
        entry = {"kv_cache_dtype": str(getattr(module, "kv_cache_dtype", ""))}
        for kind in ("k", "v", "q"):
            tensor = getattr(module, f"_{kind}_scale", None)
            if tensor is not None:
                entry[kind] = tensor.detach().float().cpu().flatten().tolist()
            value = getattr(module, f"_{kind}_scale_float", None)
            if value is not None:
                entry[f"{kind}_float"] = float(value)
        scales[name] = entry
    return scales


def _platform():
    import torch

    if torch.cuda.is_available():
        return {"device": "cuda", "name": torch.cuda.get_device_name(0)}
    return {"device": "cpu", "avx512": bool(torch.cpu._is_avx512_supported()),
            "amx": bool(torch.cpu._is_amx_tile_supported())}


def _outputs(llm, prompts, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=1)
    # A prompt is text, or a list of token ids (the exact tokens another run scored).
    prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    results = []
    for output in llm.generate(prompts, params, use_tqdm=False):
        positions = []
        pairs = zip(output.prompt_token_ids, output.prompt_logprobs or [], strict=False)
        for token_id, logprobs in pairs:
            if not logprobs:  # the first prompt token has no prediction
                continue
            top = min(logprobs.items(), key=lambda item: item[1].rank)[0]
            positions.append([token_id, logprobs[token_id].logprob, top])
        completion = output.outputs[0]
        results.append({"text": completion.text, "token_ids": list(completion.token_ids),
                        "prompt_logprobs": positions})
    return results


def main():
    request, result_path = read_request(sys.argv[1]), sys.argv[2]
    result = {"schema_version": VLLM_PROBE_SCHEMA, "started": False, "error": None}
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model ships read_scales
    try:
        import vllm
    except Exception as exc:
        result["error"] = f"cannot import vllm in {sys.executable}: {error_text(exc)}"
        return finish(result, result_path, 3)
    result["vllm_version"] = vllm.__version__
    result["platform"] = _platform()
    started = time.perf_counter()
    try:
        llm = vllm.LLM(
            model=request["model"],
            kv_cache_dtype=request["kv_cache_dtype"],
            max_model_len=request.get("max_model_len"),
            kv_cache_dtype_skip_layers=request.get("skip_layers") or [],
            enforce_eager=True,
            seed=0,
        )
    except Exception as exc:
        return failed(result, result_path, exc, 4)
    result["started"] = True
    result["start_seconds"] = round(time.perf_counter() - started, 2)
    try:
        # Imported by name so that pickle finds read_scales in vLLM's worker processes.
        import vllm_probe

        result["scales"] = llm.apply_model(vllm_probe.read_scales)[0]
        if request.get("prompts"):
            result["outputs"] = _outputs(llm, request["prompts"], request.get("max_tokens", 16))
        code = finish(result, result_path, 0)
    except Exception as exc:
        code = failed(result, result_path, exc, 5)
    shutdown(llm.llm_engine.engine_core)
    return code


if __name__ == "__main__":
    sys.exit(main())
