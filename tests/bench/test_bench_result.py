"""`bench`'s own arithmetic, against values worked out by hand: the median and range over
repeats, the useful concurrency (worst repeat within both targets) and the exit code."""

from __future__ import annotations

from kvcalib.bench.result import BenchResult, CacheRun, spread, useful_concurrency


def _row(concurrency: int, ttft: list[float], tpot: list[float]) -> dict:
    return {"concurrency": concurrency, "p99_ttft_ms": spread(ttft), "p99_tpot_ms": spread(tpot)}


def test_spread_is_median_and_range():
    assert spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert spread([1.0, 4.0]) == {"median": 2.5, "min": 1.0, "max": 4.0}


def test_useful_concurrency_takes_the_worst_repeat():
    rows = [_row(1, [100, 120], [30, 31]), _row(4, [200, 260], [40, 49]),
            _row(8, [300, 310], [45, 61])]
    assert useful_concurrency(rows, None, 50) == 4  # 8's worst TPOT is 61
    assert useful_concurrency(rows, 250, 50) == 1  # 4's worst TTFT is 260
    assert useful_concurrency(rows, 50, None) is None
    assert useful_concurrency(rows, None, None) is None


def _result(auto: int | None, fp8: int | None, targets: bool = True) -> BenchResult:
    caches = [CacheRun("auto", True, useful_concurrency=auto),
              CacheRun("fp8", True, useful_concurrency=fp8)]
    return BenchResult("ckpt", {}, {"max_ttft_ms": None, "max_tpot_ms": 50 if targets else None},
                       caches, "python")


def test_exit_code_gates_on_fp8_serving_fewer_than_auto():
    assert _result(4, 8).exit_code == 0
    assert _result(4, 4).exit_code == 0
    assert _result(8, 4).exit_code == 1
    assert _result(4, None).exit_code == 1
    assert _result(8, 4, targets=False).exit_code == 0
    assert BenchResult("ckpt", {}, {}, [CacheRun("fp8", False, "no AVX-512")], "p").exit_code == 2


def test_capacity_gate_compares_tokens_at_the_same_budget():
    def result(fp8_tokens: int) -> BenchResult:
        caches = [CacheRun("auto", True, served_as="bfloat16", capacity={"tokens": 46592}),
                  CacheRun("fp8", True, capacity={"tokens": fp8_tokens})]
        return BenchResult("ckpt", {}, {}, caches, "python")

    doubled = result(93184)
    assert doubled.exit_code == 0
    assert [(c.group, c.status, c.value) for c in doubled.checks] == [("capacity", "pass", 2.0)]
    assert result(46592).exit_code == 1  # vLLM stored the fp8 cache in 16 bits
    assert doubled.caches[0].label == "auto (bfloat16)" and doubled.caches[1].label == "fp8"
