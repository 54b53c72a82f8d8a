"""Models round-trip token arrays exactly; status changes are compare-and-set."""
from __future__ import annotations

import numpy as np
import pytest

from app.db import session_scope
from app.tables import EPISODE_STATES, RUN_STATES, STEP_STATES, Completion, Episode, Run, TaskInstance
from app.transitions import (EPISODE_TRANSITIONS, RUN_CANCELLABLE, RUN_TRANSITIONS, STEP_TERMINAL, STEP_TRANSITIONS,
                             TERMINAL, InvalidTransition, transition)


def _episode(s) -> Episode:
    run = Run(kind="train", config={})
    inst = TaskInstance(task_set="t", instance_id="i", repo="r", record={})
    s.add_all([run, inst])
    s.flush()
    ep = Episode(run_id=run.id, instance_id=inst.id, group_index=0, sample_index=0)
    s.add(ep)
    s.flush()
    return ep


def test_token_arrays_round_trip_exactly(any_database):
    rng = np.random.default_rng(0)
    prompt = [0, 1, 2**31 - 1, -(2**31), 49151] + rng.integers(0, 2**31 - 1, 1000).tolist()
    sampled = rng.integers(0, 49152, 300).tolist()
    logprobs = rng.standard_normal(300).astype(np.float32)
    logprobs[:3] = [np.float32(-1e-8), np.float32(-87.33654), np.finfo(np.float32).min]
    with session_scope() as s:
        ep = _episode(s)
        c = Completion(episode_id=ep.id, seq=0, request_key="k", api="chat", raw_request={"a": 1},
                       prompt_ids=prompt, sampled_ids=sampled, logprobs=logprobs.tolist())
        s.add(c)
        s.flush()
        cid = c.id
    with session_scope() as s:
        c = s.get(Completion, cid)
        assert c.prompt_ids == prompt
        assert c.sampled_ids == sampled
        assert np.array_equal(np.asarray(c.logprobs, dtype=np.float32), logprobs)  # bit-exact float32
        assert all(isinstance(v, int) for v in c.prompt_ids[:5])


def test_token_arrays_are_compact(database):
    with session_scope() as s:
        ep = _episode(s)
        s.add(Completion(episode_id=ep.id, seq=0, request_key="k", api="chat", raw_request={},
                         prompt_ids=list(range(8192)), sampled_ids=[1], logprobs=[0.0]))
    with session_scope() as s:
        raw = s.connection().exec_driver_sql("SELECT length(prompt_ids) FROM completions").scalar()
    assert raw == 8192 * 4  # 4 bytes per id, not JSON text


def test_out_of_range_ids_are_refused(database):
    with pytest.raises(Exception, match="range"):
        with session_scope() as s:
            ep = _episode(s)
            s.add(Completion(episode_id=ep.id, seq=0, request_key="k", api="chat", raw_request={}, prompt_ids=[2**31]))


def test_compare_and_set_only_one_winner(any_database):
    with session_scope() as s:
        ep_id = _episode(s).id
    with session_scope() as s:
        assert transition(s, Episode, ep_id, "preparing", expect=("queued",))
    with session_scope() as s:
        assert not transition(s, Episode, ep_id, "preparing", expect=("queued",))  # second caller loses
        assert transition(s, Episode, ep_id, "ready")
        assert not transition(s, Episode, ep_id, "completed")  # ready -> completed is not an edge
        assert transition(s, Episode, ep_id, "running")
        assert not transition(s, Episode, ep_id, "grading", where={"attempts": 5})  # stale attempt loses
        assert transition(s, Episode, ep_id, "grading", where={"attempts": 0})
    with session_scope() as s:
        assert s.get(Episode, ep_id).status == "grading"
        with pytest.raises(InvalidTransition):
            transition(s, Episode, ep_id, "exploded")


def _left(table: dict[str, tuple[str, ...]]) -> set[str]:
    """States some transition of `table` leaves (an allowed predecessor of some target)."""
    return {state for preds in table.values() for state in preds}


def test_terminal_states_are_the_ones_no_transition_leaves():
    for table, states, terminal in ((RUN_TRANSITIONS, RUN_STATES, TERMINAL),
                                    (EPISODE_TRANSITIONS, EPISODE_STATES, TERMINAL),
                                    (STEP_TRANSITIONS, STEP_STATES, STEP_TERMINAL)):
        assert set(table) | _left(table) == set(states)  # the tables name exactly the column's states
        assert set(states) - _left(table) == set(terminal)
    assert set(RUN_CANCELLABLE) == set(RUN_STATES) - set(TERMINAL) - {"cancelling"}


def test_no_transition_leaves_a_terminal_state(any_database):
    with session_scope() as s:
        ep_id = _episode(s).id
    with session_scope() as s:
        assert transition(s, Episode, ep_id, "cancelled")
    with session_scope() as s:
        assert not any(transition(s, Episode, ep_id, target) for target in EPISODE_TRANSITIONS)
    with session_scope() as s:
        assert s.get(Episode, ep_id).status == "cancelled"
