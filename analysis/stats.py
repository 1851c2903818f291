"""The few statistics the analyses report, in the standard library, each documented.

- ``bootstrap_interval``: the paired bootstrap's percentile interval of a mean. Resample
  ``b`` of ``resamples``: ``random.Random(seed).choices(values, k=len(values))`` drawn in
  order from one generator; the interval is the (1-level)/2 and (1+level)/2 percentiles of
  the resample means, linearly interpolated (numpy's default ``percentile``).
- ``sign_test``: the exact two-sided binomial sign test, p = min(1, 2 P(X <= min(k, n-k)))
  for X ~ Binomial(n, 1/2) over the n non-zero differences.
- ``wilson``: the Wilson score interval of a proportion (95%: z = 1.959964).
- ``mean_interval``: mean ± z standard errors (sample std, n-1).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

Z95 = 1.959963984540054


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, linear interpolation."""
    position = (len(sorted_values) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = position - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


def bootstrap_interval(
    values: Sequence[float], *, resamples: int, seed: int, level: float = 0.95
) -> tuple[float, float]:
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    tail = (1 - level) / 2 * 100
    return percentile(means, tail), percentile(means, 100 - tail)


def sign_test(differences: Sequence[float]) -> float | None:
    """Two-sided p-value over the non-zero differences; None when all are zero."""
    positive = sum(d > 0 for d in differences)
    n = positive + sum(d < 0 for d in differences)
    if n == 0:
        return None
    k = min(positive, n - positive)
    tail = sum(math.comb(n, i) for i in range(k + 1))
    return min(1.0, 2 * tail / 2**n)


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def mean_interval(values: Sequence[float], z: float = Z95) -> tuple[float, float]:
    m = mean(values)
    if len(values) < 2:
        return (m, m)
    sd = math.sqrt(math.fsum((v - m) ** 2 for v in values) / (len(values) - 1))
    half = z * sd / math.sqrt(len(values))
    return (m - half, m + half)


def normalised(values: Sequence[float]) -> list[float]:
    """(value - group mean) / group std (population std, as GRPO); zeros when std is 0."""
    m = mean(values)
    sd = math.sqrt(math.fsum((v - m) ** 2 for v in values) / len(values))
    return [0.0 if sd == 0 else (v - m) / sd for v in values]
