"""`app.cli.client`'s pure pieces (the API-backed ones run through the commands in test_runs.py)."""
from __future__ import annotations

from app.cli.client import samples_of


def test_failed_episodes_count_as_unresolved_and_cancelled_ones_are_left_out():
    episodes = [{"instance_id": "a", "status": "completed", "resolved": True},
                {"instance_id": "a", "status": "failed", "resolved": None},
                {"instance_id": "a", "status": "cancelled", "resolved": None},
                {"instance_id": "b", "status": "running", "resolved": None}]
    assert samples_of(episodes) == {"a": [True, False]}
