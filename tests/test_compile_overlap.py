"""`profiling.studies.compile_overlap --versus`: the drop-in's compiled step against
torch's, summarised over interleaved rounds by the median ratio and a confidence interval
that holds whatever the rounds' distribution."""

from __future__ import annotations

import math
import random

import pytest

from profiling.studies.compile_overlap import ratio_summary


def order_statistic_interval(n: int, confidence: float) -> tuple[int, int]:
    """The 1-based ranks (j, k) of the distribution-free interval for a median, worked
    out from the binomial count of rounds below it: the widest tail on each side whose
    probability is at most (1 - confidence) / 2."""
    tail = (1 - confidence) / 2
    below = 0.0
    j = 0
    while below + math.comb(n, j) / 2**n <= tail:
        below += math.comb(n, j) / 2**n
        j += 1
    assert j >= 1, f"{n} rounds are too few for a {confidence:.0%} interval"
    return j, n + 1 - j  # symmetric: P(B < j) = P(B > n - j)


@pytest.mark.parametrize("n", [9, 40, 120, 481])
def test_the_interval_is_the_jth_smallest_and_largest_ratio(n: int) -> None:
    ratios = [1 + (i - n / 2) / (10 * n) for i in range(n)]
    random.Random(n).shuffle(ratios)  # the rounds come in no order
    ranked = sorted(ratios)
    j, k = order_statistic_interval(n, 0.95)
    summary = ratio_summary(ratios)
    assert (summary["ratio_low"], summary["ratio_high"]) == (ranked[j - 1], ranked[k - 1])
    assert summary["ratio_low"] <= summary["ratio"] <= summary["ratio_high"]
    assert (summary["ratio_min"], summary["ratio_max"]) == (ranked[0], ranked[-1])
    assert summary["rounds"] == n


def test_nine_rounds_give_the_second_and_eighth() -> None:
    # P(at most 1 of 9 below the median) = 10/512 < 2.5%, P(at most 2) = 46/512 > 2.5%
    summary = ratio_summary([0.97, 1.05, 0.99, 1.01, 0.95, 1.03, 1.00, 1.02, 0.98])
    assert (summary["ratio_low"], summary["ratio"], summary["ratio_high"]) == (0.97, 1.00, 1.03)


def test_too_few_rounds_have_no_interval() -> None:
    summary = ratio_summary([1.0, 1.1, 0.9, 1.02, 0.98])
    assert math.isnan(summary["ratio_low"]) and math.isnan(summary["ratio_high"])
    assert summary["ratio"] == 1.0
