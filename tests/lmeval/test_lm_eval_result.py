"""`lm-eval`'s own arithmetic, against exact computations and tables worked out by hand:
McNemar's exact test, the needle-depth buckets, the paired comparison, recovery and the
exit code."""

from __future__ import annotations

from fractions import Fraction
from math import comb

import pytest

from kvcalib.errors import UsageError
from kvcalib.lmeval.options import AUTO, FP8, SCALE_ONE
from kvcalib.lmeval.result import ConfigRun, LmEvalResult, compare, depth_bucket
from kvcalib.stats import MIN_SAMPLES, mcnemar, wilson


def _binomial_two_sided(b: int, c: int) -> float:
    """The exact two-sided binomial test as scipy.stats.binomtest defines it: the total
    probability of every outcome no likelier than the one seen (p = 1/2), in fractions."""
    n = b + c
    pmf = [Fraction(comb(n, k), 2**n) for k in range(n + 1)]
    return float(min(1, sum(p for p in pmf if p <= pmf[b])))


@pytest.mark.parametrize("b, c", [(0, 5), (1, 9), (3, 3), (2, 11), (7, 1), (0, 1), (20, 9)])
def test_mcnemar_is_the_exact_binomial_test(b, c):
    assert mcnemar(b, c) == pytest.approx(_binomial_two_sided(b, c), rel=1e-12)


def test_mcnemar_by_hand():
    assert mcnemar(0, 5) == 2 / 32  # only the all-or-nothing outcomes are as extreme
    assert mcnemar(1, 9) == 22 / 1024  # 2 * (1 + 10) / 2^10
    assert mcnemar(0, 0) == 1.0 and mcnemar(4, 4) == 1.0


def test_depth_buckets():
    assert depth_bucket([10, 10, 110]) == "0-20%"
    assert depth_bucket([10, 29, 110]) == "0-20%"
    assert depth_bucket([10, 30, 110]) == "20-40%"
    assert depth_bucket([10, 109, 110]) == "80-100%"
    assert depth_bucket(None) is None


def _samples(scores: list[float], task: str = "niah_single_1", length: int = 1024) -> list:
    return [{"task": task, "length": length, "doc_id": i, "prompt_hash": f"h{i}",
             "score": s, "depth": "0-20%"} for i, s in enumerate(scores)]


def test_compare_counts_discordant_pairs_and_says_better_only_outside_noise():
    # 30 pairs: 10 both right, 2 only a right, 14 only b right, 4 both wrong.
    a = [1.0] * 10 + [1.0] * 2 + [0.0] * 14 + [0.0] * 4
    b = [1.0] * 10 + [0.0] * 2 + [1.0] * 14 + [0.0] * 4
    found = compare("x", _samples(a), "y", _samples(b))
    assert (found["n"], found["only_a"], found["only_b"]) == (30, 2, 14)
    assert found["difference"] == pytest.approx((24 - 12) / 30)
    assert found["p_value"] == pytest.approx(_binomial_two_sided(2, 14))
    assert found["low"] > 0 and found["low"] < 0.4 < found["high"]
    assert found["verdict"] == "y is better than x"
    same = compare("x", _samples(a), "y", _samples(a))
    assert same["verdict"] == "within noise" and same["p_value"] == 1.0
    # 1 discordant pair in 30: not a difference
    c = list(a)
    c[20] = 1.0
    assert compare("x", _samples(a), "y", _samples(c))["verdict"] == "within noise"


def test_compare_says_too_few_below_min_samples_and_refuses_other_prompts():
    few = [1.0] * (MIN_SAMPLES - 1)
    assert "too few samples" in compare("x", _samples(few), "y", _samples(few))["verdict"]
    other = _samples([1.0] * 12)
    other[3]["prompt_hash"] = "different"
    with pytest.raises(UsageError, match="different prompts"):
        compare("x", _samples([1.0] * 12), "y", other)


def _result(auto: list[float], one: list[float], fp8: list[float] | None,
            gate: float = 0.95) -> LmEvalResult:
    runs = [ConfigRun(AUTO, "auto", True, samples=_samples(auto)),
            ConfigRun(SCALE_ONE, "fp8", True, samples=_samples(one)),
            ConfigRun(FP8, "fp8", fp8 is not None, None if fp8 is not None else "no AVX-512",
                      samples=_samples(fp8 or []))]
    return LmEvalResult("ckpt", {"min_recovery": gate, "tasks": [], "lengths": [1024],
                                 "limit": 20}, runs, "python")


def test_recovery_and_the_gate():
    auto = [1.0] * 20  # 100%
    result = _result(auto, [1.0] * 10 + [0.0] * 10, [1.0] * 19 + [0.0])
    assert result.recovery(SCALE_ONE) == 0.5 and result.recovery(FP8) == 0.95
    assert result.exit_code == 0  # 95% is not below 95%
    assert [(c.group, c.status, c.value) for c in result.checks] == [
        ("quality", "pass", 0.5), ("quality", "pass", 0.95)]  # scale 1.0 is not gated
    assert any("scale 1.0 keeps 50.0%" in line and "calibrate" in line
               for line in result.verdict())
    assert _result(auto, auto, [1.0] * 18 + [0.0] * 2).exit_code == 1  # 90%
    assert _result(auto, auto, [1.0] * 18 + [0.0] * 2, gate=0.9).exit_code == 0
    assert _result(auto, auto, None).exit_code == 0  # fp8 not run: no gate to fail
    assert _result([0.0] * 20, auto, auto).recovery(FP8) is None  # auto found nothing
    nothing = LmEvalResult("ckpt", {"min_recovery": 0.95}, [ConfigRun(AUTO, "auto", False)], "p")
    assert nothing.exit_code == 2
    assert [c.status for c in nothing.checks] == ["skip", "error"]


def test_table_accuracy_is_the_fraction_with_an_interval():
    result = _result([1.0] * 15 + [0.0] * 5, [1.0] * 20, [1.0] * 20)
    row = next(r for r in result.table() if r["config"] == AUTO)
    assert (row["n"], row["accuracy"]) == (20, 0.75)
    assert (row["low"], row["high"]) == wilson(15, 20)
    assert result.depth_table()[0] == {"config": AUTO, "length": 1024, "depth": "0-20%",
                                       "n": 20, "accuracy": 0.75}


def test_wilson_interval_against_published_values():
    # Newcombe (1998), Statistics in Medicine 17:857, Table I, method 3 (Wilson's score
    # interval without continuity correction), to the 4 decimals printed there.
    for (k, n), published in {(81, 263): (0.2553, 0.3662), (15, 148): (0.0624, 0.1605),
                              (0, 20): (0.0, 0.1611), (1, 29): (0.0061, 0.1718)}.items():
        assert wilson(k, n) == pytest.approx(published, abs=5e-5)
