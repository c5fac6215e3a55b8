"""The benchmark harness's statistics: median, percentiles, paired ratios."""

from __future__ import annotations

import math

import numpy as np
import pytest

from specserve.benchmarks import stats as st


def test_median_odd_even_and_empty():
    assert st.median([3, 1, 2]) == 2
    assert st.median([4, 1, 3, 2]) == 2.5
    assert st.median([]) is None
    assert st.median([None, float("nan"), 5.0]) == 5.0


@pytest.mark.parametrize("q", [0, 1, 10, 25, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    rng = np.random.default_rng(0)
    xs = rng.exponential(size=37).tolist()
    assert st.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_percentile_edge_cases():
    assert st.percentile([7.0], 99) == 7.0
    assert st.percentile([], 50) is None
    assert st.percentiles([1, 2, 3, 4]) == {"p50": 2.5, "p90": pytest.approx(3.7), "p99": pytest.approx(3.97)}
    with pytest.raises(ValueError):
        st.percentile([1], 101)


def test_paired_ratios_pair_by_key_and_drop_unpaired():
    a = {("p1", 0): 10.0, ("p1", 1): 12.0, ("p2", 0): 9.0, ("p3", 0): 5.0}
    b = {("p1", 0): 5.0, ("p1", 1): 4.0, ("p2", 0): 0.0, ("p4", 0): 1.0}
    # p2 has a zero denominator and p3/p4 are unpaired: only p1's two repeats count.
    assert st.paired_ratios(a, b) == [2.0, 3.0]
    assert st.median_paired_ratio(a, b) == 2.5
    assert st.median_paired_ratio({}, b) is None


def test_paired_ratio_is_robust_to_one_noisy_pair():
    # A load burst slows one pair 10x: the median of paired ratios is unmoved, a ratio of means is not.
    method = {i: 20.0 for i in range(5)}
    base = {i: 10.0 for i in range(5)}
    method[3], base[3] = 2.0, 1.0  # both slowed in the same pair: ratio still 2
    method[4] = 1.0  # only the method slowed
    assert st.median_paired_ratio(method, base) == 2.0


def test_geomean_mean_and_prefix():
    assert st.geomean([1, 4]) == pytest.approx(2.0)
    assert st.mean([1, 2, None]) == 1.5
    assert st.common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
    assert st.common_prefix_len([], [1]) == 0
    assert st.round_or_none(None) is None
    assert math.isclose(st.round_or_none(1.23456, 2), 1.23)
