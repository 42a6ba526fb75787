"""Pearson's chi-square goodness of fit, by hand (scipy is not a dependency), for the speculative tests."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping

Z_ALPHA_0_001 = 3.090  # the standard normal's upper 0.1% point: a correct sampler fails 1 run in 1000
MIN_EXPECTED = 5.0  # bins expecting fewer samples are pooled (the chi-square approximation needs >= 5)


def chi_square_critical(df: int, z: float = Z_ALPHA_0_001) -> float:
    """The chi-square upper critical value by the Wilson-Hilferty approximation (within 1% for df >= 2)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi_square(samples: Iterable[int], probs: Mapping[int, float]) -> tuple[float, int]:
    """(statistic, degrees of freedom) of `samples` against `probs`; rare outcomes pooled into one bin."""
    counts = Counter(samples)
    total = sum(counts.values())
    assert total > 0
    assert set(counts) <= {t for t, p in probs.items() if p > 0}, "sampled a token of probability 0"
    bins: list[tuple[float, float]] = []  # (observed, expected)
    pooled_observed = pooled_expected = 0.0
    for token, p in probs.items():
        expected = p * total
        if expected >= MIN_EXPECTED:
            bins.append((counts.get(token, 0), expected))
        else:
            pooled_observed += counts.get(token, 0)
            pooled_expected += expected
    if pooled_expected > 0:
        bins.append((pooled_observed, pooled_expected))
    statistic = sum((o - e) ** 2 / e for o, e in bins if e > 0)
    return statistic, len(bins) - 1


def assert_distributed_as(samples: list[int], probs: Mapping[int, float]) -> None:
    """Fail when the chi-square statistic exceeds the 0.1% critical value."""
    statistic, df = chi_square(samples, probs)
    assert df >= 1, "the distribution needs at least two bins to test"
    critical = chi_square_critical(df)
    assert statistic < critical, f"chi-square {statistic:.1f} >= {critical:.1f} (df {df}, n {len(samples)})"
