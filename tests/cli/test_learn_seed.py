"""`turnstile learn`'s seed (TURNSTILE_LEARN_SEED / --seed) and its figure with the held-out curve."""
from __future__ import annotations

import pytest

from app.cli import learning


def test_a_seed_is_put_on_every_split_spec_and_one_that_does_not_exist_stops_learn():
    assert learning.seeded("family:train", 1) == "family:train@1"
    assert learning.seeded("family:train@0", 1) == "family:train@0"  # named already
    assert learning.seeded(["a", "b"], 1) == ["a", "b"] and learning.seeded("family:train", None) == "family:train"
    assert learning.learn_seed("2") == 2 and learning.learn_seed(None) is None and learning.learn_seed("") is None
    with pytest.raises(SystemExit, match="is not a seed"):
        learning.learn_seed("one")
    assert learning._ids("family:heldout@1") != learning._ids("family:heldout@0")
    with pytest.raises(SystemExit, match="has split seeds 0, 1, not '5'"):
        learning._ids(learning.seeded("family:heldout", 5))


def test_the_figure_draws_the_held_out_curve_with_the_before_run_as_step_0(tmp_path):
    train = {"id": 7, "summary": {"steps": [{"step": i, "reward_mean": 0.25 * (i % 3)} for i in range(12)]},
             "heldout": [{"step": 6, "pass_at_1": 0.3, "low": 0.2, "high": 0.4},
                         {"step": 12, "pass_at_1": None, "low": None, "high": None}]}
    comparison = {"before": {"value": 0.1, "low": 0.05, "high": 0.2}, "after": {"value": 0.3, "low": 0.2, "high": 0.4},
                  "difference": {"value": 0.2, "low": 0.1, "high": 0.3}}
    png = learning.draw(tmp_path / "learning.png", train, comparison)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
