"""`app.stats`: pass@1, Chen's pass@k, the Wilson interval, the paired clustered bootstrap, the percentile."""
from __future__ import annotations

import itertools
import math

import pytest

from app.stats import compare_samples, pass_at_1, pass_at_k, percentile, wilson


def test_pass_at_1_is_the_mean_of_per_instance_rates():
    # instance a: 1 of 4, instance b: 2 of 2 -> (0.25 + 1.0) / 2, not 3 / 6
    assert pass_at_1({"a": [True, False, False, False], "b": [True, True]}) == pytest.approx(0.625)


def test_no_change_gives_a_zero_difference_whose_interval_holds_zero():
    runs = {f"i{k}": [k % 3 == 0, k % 2 == 0, False, True] for k in range(8)}
    result = compare_samples(runs, runs, replicates=2000, seed=1)
    assert result.difference.value == 0.0
    assert result.difference.low < 0.0 < result.difference.high
    assert result.before.low <= result.before.value <= result.before.high


def test_a_clear_gain_has_an_interval_above_zero_and_a_wide_one_for_few_instances():
    before = {f"i{k}": [False] * 4 for k in range(10)}
    after = {f"i{k}": [True, True, True, False] for k in range(10)}
    result = compare_samples(before, after, replicates=2000, seed=0)
    assert result.difference.value == pytest.approx(0.75)
    assert 0.4 < result.difference.low <= 0.75 <= result.difference.high <= 1.0
    assert (result.before.low, result.before.high) == (0.0, 0.0)
    # one instance carries all the gain: instance resampling makes the interval reach 0
    lopsided = compare_samples(before, {**before, "i0": [True] * 4}, replicates=2000, seed=0)
    assert lopsided.difference.value == pytest.approx(0.1)
    assert lopsided.difference.low == 0.0


def test_bootstrap_is_reproducible_and_uses_only_shared_instances():
    before = {"a": [True, False], "b": [False, False], "only_before": [True]}
    after = {"a": [True, True], "b": [False, True]}
    one, two = compare_samples(before, after, seed=3, replicates=500), compare_samples(before, after, seed=3, replicates=500)
    assert one == two and one.instances == 2 and one.samples_before == 4


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="no instance with samples in common"):
        compare_samples({"a": [True]}, {"b": [True]})
    with pytest.raises(ValueError, match="replicates"):
        compare_samples({"a": [True]}, {"a": [True]}, replicates=10)


def test_wilson_interval_stays_open_where_the_bootstrap_collapses():
    low, high = wilson(0, 18)
    assert low == 0.0 and high == pytest.approx(0.1759, abs=1e-3)
    low, high = wilson(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-3) and high == pytest.approx(0.7634, abs=1e-3)
    assert wilson(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="within"):
        wilson(3, 2)


def test_wilson_uses_the_exact_95_percent_quantile():
    # z = 1.959964 (not 1.96): at 1 of 2 the bounds are 0.0945 and 0.9055 (Wilson 1927)
    low, high = wilson(1, 2)
    assert low == pytest.approx(0.094531, abs=1e-6) and high == pytest.approx(0.905469, abs=1e-6)


def _pass_at_k_by_subsets(n: int, c: int, k: int) -> float:
    """The definition behind Chen et al.'s estimator: over every k-subset of the n samples,
    the fraction that holds at least one resolved sample."""
    flags = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(flags[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n,c,k", [(4, 1, 1), (4, 1, 2), (5, 2, 3), (6, 0, 2), (6, 6, 3), (7, 3, 7)])
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_resolved_sample(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_by_subsets(n, c, k))


def test_pass_at_k_at_k_1_is_the_resolved_fraction_and_undefined_for_too_few_samples():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    assert pass_at_k(3, 1, 4) is None and pass_at_k(3, 1, 0) is None
    assert pass_at_k(200, 1, 100) == pytest.approx(1 - math.comb(199, 100) / math.comb(200, 100))


def test_percentile_is_the_nearest_rank_value():
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 3.0  # index round(1.5) = 2
    assert percentile([5.0, 1.0], 0.99) == 5.0 and percentile([5.0, 1.0], 0.0) == 1.0
