"""`python -m app compare`: pass@1 and its paired, clustered bootstrap intervals (pure functions, no server)."""
from __future__ import annotations

import pytest

from app.cli.compare import compare_samples, pass_at_1, samples_of


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


def test_failed_episodes_count_as_unresolved_and_cancelled_ones_are_left_out():
    episodes = [{"instance_id": "a", "status": "completed", "resolved": True},
                {"instance_id": "a", "status": "failed", "resolved": None},
                {"instance_id": "a", "status": "cancelled", "resolved": None},
                {"instance_id": "b", "status": "running", "resolved": None}]
    assert samples_of(episodes) == {"a": [True, False]}


def test_wilson_interval_stays_open_where_the_bootstrap_collapses():
    from app.cli.compare import wilson

    low, high = wilson(0, 18)
    assert low == 0.0 and high == pytest.approx(0.1759, abs=1e-3)
    low, high = wilson(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-3) and high == pytest.approx(0.7634, abs=1e-3)
    assert wilson(0, 0) == (0.0, 1.0)
