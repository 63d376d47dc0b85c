"""`kvcalib estimate` on the real demo model, and against the engine's own count."""

from __future__ import annotations

import json

import pytest

from conftest import assert_error, run_kvcalib
from kvcalib.kvcache import capacity

GiB = 2**30


def test_smollm2_one_gib_as_vllm_cpu_counts_it(demo_model):
    """vLLM 0.32.0 on CPU (128-token blocks) reported 46,592 tokens for the bf16 cache and
    93,184 for fp8 with VLLM_CPU_KVCACHE_SPACE=1."""
    config = json.loads((demo_model / "config.json").read_text())
    result = capacity.from_config(config, capacity.EstimateOptions(
        context_length=2048, budget="1GiB", block_size=128))
    formats = {f.name: f for f in result.formats}
    bf16 = 2 * 30 * 3 * 64 * 2  # 23,040 bytes per token
    assert formats["bfloat16"].tokens_fit == GiB // (128 * bf16) * 128
    assert formats["fp8"].tokens_fit == GiB // (128 * bf16 // 2) * 128
    assert (formats["bfloat16"].tokens_fit, formats["fp8"].tokens_fit) == (46_592, 93_184)
    assert formats["fp8"].max_concurrency == GiB // (2048 * bf16 // 2) == 45
    # KIVI at 2,048 tokens, G = 32, R = 128, C = 192: 60 key groups, 1,920 quantized values
    keys = 60 * (32 * 48 + 4 * 192) + 128 * 192 * 2
    values = 1920 * (48 + 4 * 3 * 2) + 128 * 192 * 2
    assert formats["kivi2"].request_bytes == 30 * (keys + values) == 11_243_520


def test_cli_table_on_the_demo_model(demo_model):
    result = run_kvcalib("estimate", demo_model, "--budget", "1", "--block-size", 128,
                         "--context-length", 2048)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()
            if line.startswith(("bfloat16", "fp8", "kivi2"))}
    assert rows["bfloat16"][0] == "23,040" and rows["bfloat16"][-2:] == ["46,592", "22"]
    assert rows["fp8"][0] == "11,520" and rows["fp8"][-2:] == ["93,184", "45"]
    assert "30 attention layers of 30, 3 KV heads x 64 dims (GQA, 9 query heads)" in (
        result.stdout)


def test_cli_formats_size_every_vllm_format(demo_model):
    """`estimate --formats` sizes vLLM's other formats as `eval --formats` does: SmolLM2's
    30 layers x 3 KV heads x 64 dims, per token and layer: int8_per_token_head 2·64 data
    bytes + two fp32 scales per head; turboquant_k8v4 (64 + 32 + 4) per head with layers
    0, 1, 28 and 29 in bf16; nvfp4 2·3 slots of 32 FP4 bytes + 4 E4M3 block scales."""
    result = run_kvcalib("estimate", demo_model, "--formats", "int8_per_token_head,"
                         "turboquant_k8v4,nvfp4", "--budget", "2GiB", "--json", "-")
    assert result.returncode == 0, result.stderr
    formats = {f["name"]: f for f in json.loads(result.stdout)["formats"]}
    assert list(formats) == ["int8_per_token_head", "turboquant_k8v4", "nvfp4"]
    int8 = 30 * 3 * (2 * 64 + 2 * 4)
    assert formats["int8_per_token_head"]["bytes_per_token"] == int8 == 12_240
    assert formats["int8_per_token_head"]["tokens_fit"] == 2 * GiB // (16 * int8) * 16
    assert formats["turboquant_k8v4"]["bytes_per_token"] == 26 * 3 * 100 + 4 * 2 * 3 * 64 * 2
    assert formats["nvfp4"]["bytes_per_token"] == 30 * 2 * 3 * (32 + 4) == 6480
    everything = run_kvcalib("estimate", demo_model, "--formats", "all", "--json", "-")
    names = [f["name"] for f in json.loads(everything.stdout)["formats"]]
    assert names[0] == "bfloat16" and names[-1] == "kivi2" and "ultraquant_4bit" in names


@pytest.mark.parametrize(("args", "message"), [
    (["--budget", "lots"], "Error: budget 'lots' is not a size"),
    (["--kv-cache-dtype-skip-layers", "0,99"], "skip layer 99 is not an attention layer"),
    (["--context-length", "0"], "Invalid value for '--context-length'"),
    (["--formats", "fp4"], "unknown format 'fp4'; valid: all, auto, fp8"),
])
def test_cli_bad_options(demo_model, args, message):
    assert_error(run_kvcalib("estimate", demo_model, *args), 2, message)


@pytest.mark.engine
def test_budget_agrees_with_vllm(verify_compare, smol_attn_head):
    """vLLM's own count (VLLM_CPU_KVCACHE_SPACE=1, 128-token blocks on CPU, max_model_len
    2048) from the shared `verify --compare-auto` start-ups, against `estimate`."""
    engine = verify_compare["report"]["engine"]
    capacity_seen = engine["compare_auto"]["capacity"]
    result = run_kvcalib("estimate", smol_attn_head, "--budget", "1GiB", "--block-size", 128,
                         "--context-length", 2048, "--json", "-")
    assert result.returncode == 0, result.stderr
    formats = {f["name"]: f for f in json.loads(result.stdout)["formats"]}
    print(f"vLLM: {capacity_seen}; estimate: bf16 {formats['bfloat16']['tokens_fit']}, "
          f"fp8 {formats['fp8']['tokens_fit']}")
    assert abs(formats["fp8"]["tokens_fit"] - capacity_seen["fp8_tokens"]) < 128
    assert abs(formats["bfloat16"]["tokens_fit"] - capacity_seen["auto_tokens"]) < 128
    # vLLM's "Maximum concurrency for 2,048 tokens per request: 45.50x" is tokens / length
    fp8_run = engine["runs"]["fp8"]["capacity"]
    assert fp8_run["request_tokens"] == 2048
    assert formats["fp8"]["max_concurrency"] == int(fp8_run["max_concurrency"])
