"""Capture rows per attempt and per call (app.proxy.record), on real SQLite and PostgreSQL.

A retried rollout attempt never overwrites the lost attempt's rows; two identical calls whose
answers both reached the harness are two rows; a dead try (partial) is replaced by its retry,
and a dead try that finishes after its retry was stored is dropped.
"""
from __future__ import annotations

from support.gateway import completions, make_episode

from app.proxy.canonical import Result
from app.proxy.record import Capture, write_completion


def _write(ep: int, key: str, sampled: list[int], *, attempt: int = 1, received_at: float = 0.0,
           partial: bool = False) -> int:
    cap = Capture(episode_id=ep, api="chat", model="m", stream=False, request_key=key, attempt=attempt,
                  raw_request={"received_at": received_at, "body": {}}, normalized_request={"messages": []},
                  policy_version_fallback=0)
    result = Result(prompt_ids=[1, 2], sampled_ids=sampled, logprobs=[-0.5] * len(sampled), finish_reason="stop")
    return write_completion(cap, result, {"ok": 1}, "id", partial=partial,
                            error="client disconnected" if partial else None)


def test_attempt_two_never_overwrites_attempt_one(any_database):
    ep, _ = make_episode()
    first = _write(ep, "same-body", [10, 11], attempt=1, received_at=1.0)
    second = _write(ep, "same-body", [20], attempt=2, received_at=2.0)
    rows = completions(ep)
    assert first != second and [(r.attempt, r.sampled_ids, r.seq) for r in rows] == [(1, [10, 11], 0), (2, [20], 1)]


def test_identical_deliberate_calls_are_two_rows(any_database):
    ep, _ = make_episode()
    a = _write(ep, "k", [5], received_at=1.0)
    b = _write(ep, "k", [6], received_at=2.0)  # sent again after the first answer came back whole
    assert a != b and [r.sampled_ids for r in completions(ep)] == [[5], [6]]


def test_a_retry_replaces_its_dead_try_and_a_late_dead_try_is_dropped(any_database):
    ep, _ = make_episode()
    dead = _write(ep, "k", [1], received_at=1.0, partial=True)   # the client gave up on this try
    retry = _write(ep, "k", [2, 3], received_at=2.0)            # the SDK's retry, answered whole
    assert retry == dead
    late = _write(ep, "k", [4], received_at=1.5, partial=True)  # an older try that finished last
    assert late == retry
    [row] = completions(ep)
    assert row.seq == 0 and row.sampled_ids == [2, 3] and row.partial is False
    again = _write(ep, "k", [7], received_at=3.0)  # a deliberate repeat after the whole answer
    assert again != retry and [r.sampled_ids for r in completions(ep)] == [[2, 3], [7]]


def test_a_session_key_carries_its_attempt(any_database):
    """The gateway stamps each call with the attempt of the key it came with (a new key per attempt)."""
    from app import db
    from app.tables import Episode
    from app.proxy.sessions import forget, issue_session, resolve_session_info

    ep, first = make_episode()
    assert resolve_session_info(first).attempt == 1  # never claimed by a rollout: attempt 1
    with db.session_scope() as s:
        s.get(Episode, ep).attempts = 2
        second = issue_session(s, ep)
    forget(None)
    assert resolve_session_info(second).attempt == 2 and resolve_session_info(first) is None


def test_once_accepted_the_record_keeps_its_own_copy_without_the_spliced_ids():
    """Until the engine accepts, the record is the body being sent (the engine client clamps
    `max_tokens` in place, and the record shows the clamp); from then on the two are separate and
    the spliced prompt ids (recorded as the engine's own `prompt_ids`) leave the record only."""
    wire = {"messages": [], "max_tokens": 100, "prompt_token_ids": [1, 2],
            "kv_transfer_params": {"prompt_token_ids": [1, 2]}}
    cap = Capture(episode_id=1, api="chat", model="m", stream=True, request_key="k", raw_request={},
                  normalized_request=wire, policy_version_fallback=0)
    wire["max_tokens"] = 40  # clamped by the engine client before sending
    cap.accepted(12.5)
    assert cap.t_accepted == 12.5
    assert cap.normalized_request == {"messages": [], "max_tokens": 40}
    assert wire["prompt_token_ids"] == [1, 2] and "kv_transfer_params" in wire  # the wire body is untouched
    wire["max_tokens"] = 1
    assert cap.normalized_request["max_tokens"] == 40
