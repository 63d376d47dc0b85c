"""Confidence intervals over samples: is a difference between two configurations real?

Every configuration is scored on the same samples, so configurations are compared by a
paired bootstrap: resample the samples with replacement (the same indices for both), and
recompute each configuration's statistic and their difference on every resample. The 95%
interval is the 2.5th to 97.5th percentile of those values (the percentile method). A
difference whose interval includes zero is within noise.

Below MIN_SAMPLES samples no interval is drawn: the percentile bootstrap's coverage falls
far short of 95% there (about half with 2 samples, whose paired bootstrap has 3 distinct
resamples), and callers say "too few samples to tell" instead. tests/test_stats.py
measures the coverage by simulation at the sample counts kvcalib uses.

A statistic maps resampled per-sample values, shape (resamples, samples, ...), to one
number per resample: `mean` of one value per sample, `ratio_of_sums` for token-weighted
means (column 0 summed over column 1, e.g. summed KL and token count), `perplexity`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

Statistic = Callable[[np.ndarray], np.ndarray]

# The fewest samples an interval is drawn from. Measured (tests/test_stats.py,
# 400 simulated data sets each, per-sample KL normal or log-normal(0.5), and paired
# differences): the nominal 95% interval holds the true value 89-94% of the time from 12
# samples on, 87-89% with 8, 79-82% with 4 and 46-51% with 2.
MIN_SAMPLES = 12
TOO_FEW = "too few samples to tell"


def too_few(samples: int) -> str | None:
    """Why `samples` give no interval ('too few samples to tell: 4 < 12'), or None."""
    return f"{TOO_FEW}: {samples} < {MIN_SAMPLES}" if samples < MIN_SAMPLES else None


def mean(values: np.ndarray) -> np.ndarray:
    return values.mean(axis=1)


def ratio_of_sums(values: np.ndarray) -> np.ndarray:
    """Σ column 0 / Σ column 1 over the samples: a per-token mean from per-sample sums."""
    return values[..., 0].sum(axis=1) / values[..., 1].sum(axis=1)


def perplexity(values: np.ndarray) -> np.ndarray:
    """exp(Σ NLL / Σ tokens), from per-sample (summed NLL, token count) pairs."""
    return np.exp(ratio_of_sums(values))


@dataclass(frozen=True)
class Interval:
    estimate: float  # the statistic on the samples themselves
    low: float
    high: float

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


@dataclass(frozen=True)
class Comparison:
    """Configuration a (the reference) and b on the same samples, and b - a."""

    a: Interval
    b: Interval
    difference: Interval
    samples: int
    difference_se: float  # bootstrap standard error of b - a

    @property
    def within_noise(self) -> bool:
        return not self.difference.excludes_zero


def _interval(estimate: float, resampled: np.ndarray, confidence: float) -> Interval:
    tail = (1 - confidence) / 2
    low, high = np.quantile(resampled, [tail, 1 - tail])
    return Interval(float(estimate), float(low), float(high))


def _resamples(n: int, n_resamples: int, seed: int) -> np.ndarray:
    if n < 2:
        raise ValueError(f"a bootstrap needs at least 2 samples, got {n}")
    return np.random.default_rng(seed).integers(0, n, size=(n_resamples, n))


def bootstrap(values: np.ndarray, statistic: Statistic = mean, *, n_resamples: int = 2000,
              confidence: float = 0.95, seed: int = 0) -> Interval:
    """The statistic of one configuration's per-sample values, with its interval."""
    values = np.asarray(values, dtype=float)
    resampled = statistic(values[_resamples(len(values), n_resamples, seed)])
    return _interval(statistic(values[None])[0], resampled, confidence)


def paired_bootstrap(a: np.ndarray, b: np.ndarray, statistic: Statistic = mean, *,
                     n_resamples: int = 2000, confidence: float = 0.95,
                     seed: int = 0) -> Comparison:
    """Intervals for a, b and b - a from the same resampled samples (a[i] and b[i] are one
    sample under the two configurations)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired values need the same shape: {a.shape} and {b.shape}")
    index = _resamples(len(a), n_resamples, seed)
    stat_a, stat_b = statistic(a[index]), statistic(b[index])
    point_a, point_b = statistic(a[None])[0], statistic(b[None])[0]
    return Comparison(_interval(point_a, stat_a, confidence),
                      _interval(point_b, stat_b, confidence),
                      _interval(point_b - point_a, stat_b - stat_a, confidence), len(a),
                      float(np.std(stat_b - stat_a, ddof=1)))


def samples_needed(comparison: Comparison, *, confidence: float = 0.95,
                   power: float = 0.8) -> int | None:
    """Samples for the interval of b - a to exclude zero with probability `power`, if the
    difference is what was measured: n · ((z_(1-α/2) + z_power) · se / |difference|)², with
    the standard error shrinking as 1/sqrt(n); at least 2 (a bootstrap's minimum). None
    when the measured difference is 0."""
    difference = abs(comparison.difference.estimate)
    if difference == 0:
        return None
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2) + NormalDist().inv_cdf(power)
    needed = comparison.samples * (z * comparison.difference_se / difference) ** 2
    return max(2, math.ceil(needed))


def mcnemar(b: int, c: int) -> float:
    """McNemar's exact test: the two-sided binomial p-value of b successes in b + c
    discordant pairs with p = 1/2 (1.0 when there are none)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2**n
    return min(1.0, 2 * tail)


def wilson(successes: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval of a proportion: unlike a bootstrap of 0/1 scores, it does
    not shrink to a point at 0% or 100% (50 of 50 right: 92.9% to 100%)."""
    z = NormalDist().inv_cdf(1 - (1 - confidence) / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)
