"""`make learn`'s figure and numbers: moving average, reward slope, and learning.png drawn from run data."""
from __future__ import annotations

import pytest

from app.cli.learning import draw, moving_average, slope, step_series


def test_moving_average_is_trailing_and_shorter_at_the_start():
    assert moving_average([0.0, 1.0, 0.5, 0.5], window=2) == [0.0, 0.5, 0.75, 0.5]
    assert moving_average([]) == []
    with pytest.raises(ValueError):
        moving_average([1.0], window=0)


def test_slope_is_the_least_squares_reward_per_step():
    assert slope([0.0, 0.1, 0.2, 0.3]) == pytest.approx(0.1)
    assert slope([0.5, 0.5]) == 0.0
    assert slope([0.2]) is None


def test_learning_png_is_drawn_from_a_train_run_and_a_comparison(tmp_path):
    run = {"id": 7, "summary": {"steps": [
        {"step": 0, "reward_mean": 0.0, "metrics": {"loss": 0.01}},
        {"step": 1, "reward_mean": 0.25, "metrics": {"loss": -0.02}},
        {"step": 2, "reward_mean": None, "metrics": {}}]}}
    assert step_series(run) == ([0, 1], [0.0, 0.25], [0.01, -0.02])
    comparison = {"before": {"value": 0.1, "low": 0.0, "high": 0.2}, "after": {"value": 0.3, "low": 0.1, "high": 0.5},
                  "difference": {"value": 0.2, "low": 0.05, "high": 0.35}}
    png = draw(tmp_path / "runs" / "7" / "learning.png", run, comparison)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert draw(tmp_path / "no-compare.png", run, None).exists()


def test_the_step_reward_counts_every_group_drawn_for_the_step_when_dynamic_sampling_set_some_aside():
    """Trained groups alone are the mixed ones (mean near 0.5 whatever the policy does): the curve
    uses the mean over every drawn episode, and falls back to the trained mean without it."""
    run = {"summary": {"steps": [
        {"step": 0, "reward_mean": 0.5, "sampled_reward_mean": 0.125, "metrics": {"loss": -0.01}},
        {"step": 1, "reward_mean": 0.5, "sampled_reward_mean": None, "metrics": {"loss": 0.02}}]}}
    assert step_series(run) == ([0, 1], [0.125, 0.5], [-0.01, 0.02])
