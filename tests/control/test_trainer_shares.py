"""Fair turns on the trainer (`app.control.trainer_shares`) on real SQL and a real Redis: the usage
window, which runs wait for the trainer in every state a deployment holds, the yield rule with
shares, and a simulated trainer queue on which a Tinker client's burst of ops takes its share and
no more while an RL run keeps a step pending (side by side with first in, first out)."""
from __future__ import annotations

from collections import deque

import pytest

from app.control import trainer_shares
from app.db import session_scope
from app.runconfig import RunConfig
from app.tables import Run, TinkerFuture, TinkerModel, TinkerSession, TrainingStep

NOW = 1_000_000.0


def _run(kind: str = "train", status: str = "running", share: float = 1.0) -> int:
    cfg = {"kind": kind, "scheduling": {"share": share}}
    if kind == "tinker":
        cfg |= {"model": {"name": "tiny"}, "steps": 0, "training": {"lora": True, "lora_r": 8}}
    with session_scope() as s:
        run = Run(kind=kind, status=status, config=RunConfig.model_validate(cfg).model_dump(mode="json"))
        s.add(run)
        s.flush()
        return run.id


def _rl_run(step_status: str | None = "pending", status: str = "running", share: float = 1.0) -> int:
    run_id = _run("train", status, share)
    if step_status is not None:
        with session_scope() as s:
            s.add(TrainingStep(run_id=run_id, step=1, status=step_status))
    return run_id


def _tinker_run(*future_statuses: tuple[str, str], share: float = 1.0) -> int:
    """A Tinker model's run with futures of (op, status)."""
    run_id = _run("tinker", share=share)
    with session_scope() as s:
        s.add(TinkerSession(id=f"session-{run_id}", key_name="alice", sdk_version="0.38.0", tags=[], user_metadata={}))
        s.flush()
        s.add(TinkerModel(id=f"tinker-{run_id}", run_id=run_id, session_id=f"session-{run_id}", seq_id=0,
                          key_name="alice", base_model="tiny", lora_rank=8))
        s.flush()
        for i, (op, status) in enumerate(future_statuses):
            s.add(TinkerFuture(model_id=f"tinker-{run_id}", request_id=f"r-{run_id}-{i}", op=op, status=status,
                               payload={}, key_name="alice"))
    return run_id


def test_usage_counts_the_window_only(database, redis_db, monkeypatch):
    monkeypatch.setenv("TURNSTILE_TRAINER_SHARE_WINDOW_S", "60")
    from app import config
    config.reset_settings()
    trainer_shares.record(7, 5.0, now=NOW - 120)   # left the window
    trainer_shares.record(7, 1.5, now=NOW - 30)
    trainer_shares.record(7, 0.25, now=NOW)
    trainer_shares.record(8, -1.0, now=NOW)        # a clock step back counts nothing, never negative
    assert trainer_shares.usage([7, 8, 9], now=NOW) == {7: 1.75, 8: 0.0, 9: 0.0}
    assert redis_db.zcard("turnstile:trainer:usage:7") == 2  # the old entry was dropped at the later record


def test_which_runs_wait_for_the_trainer(database, redis_db):
    me = _tinker_run(("forward_backward", "pending"))
    rl_pending = _rl_run("pending")
    _rl_run("training")                      # its step is on the trainer now: not waiting
    _rl_run("completed")                     # between steps
    _rl_run(None)                            # a run that never got to a step
    _rl_run("pending", status="cancelling")  # its step will not run
    _rl_run("pending", status="queued")      # a run not started yet
    tinker_waiting = _tinker_run(("forward_backward", "completed"), ("optim_step", "pending"))
    _tinker_run(("forward_backward", "running"), ("optim_step", "pending"))  # its next op waits on its own
    _tinker_run(("sample", "pending"), ("create_model", "completed"))         # not trainer work
    _tinker_run(("forward_backward", "failed"))
    with session_scope() as s:
        assert trainer_shares.waiting_runs(s, me) == [rl_pending, tinker_waiting]
        assert me in trainer_shares.waiting_runs(s, rl_pending)


def test_a_tinker_op_yields_to_a_waiting_run_with_less_per_share(database, redis_db):
    me = _tinker_run(("forward_backward", "pending"))
    with session_scope() as s:
        assert not trainer_shares.should_yield(s, me, now=NOW)  # alone: it runs
    rl = _rl_run("pending", share=1.0)
    trainer_shares.record(me, 10.0, now=NOW)
    trainer_shares.record(rl, 20.0, now=NOW)
    with session_scope() as s:
        assert not trainer_shares.should_yield(s, me, now=NOW)  # 10 / 1 < 20 / 1
        s.get(Run, rl).config = {**s.get(Run, rl).config, "scheduling": {"share": 3.0}}
    with session_scope() as s:
        assert trainer_shares.should_yield(s, me, now=NOW)      # 20 / 3 < 10 / 1: the RL run's turn
    with session_scope() as s:
        s.get(TrainingStep, s.query(TrainingStep.id).filter_by(run_id=rl).scalar()).status = "training"
    with session_scope() as s:
        assert not trainer_shares.should_yield(s, me, now=NOW)  # its step runs already: nothing waits


def _simulate(tinker_id: int, rl_id: int, *, fair: bool, seconds: float = 240.0, op_s: float = 0.25,
              step_s: float = 2.0, inflight: int = 16) -> float:
    """One trainer taking messages first in, first out: an RL run that always has its next step
    pending (sent as the last one ends) and a Tinker client keeping `inflight` ops queued.  With
    `fair`, a Tinker op asks `should_yield` first and, yielding, goes to the back of the queue (as
    its task's retry does).  Returns the Tinker run's fraction of the trainer's busy seconds."""
    queue = deque(["tinker"] * inflight + ["rl"])
    clock, used = NOW, {"tinker": 0.0, "rl": 0.0}
    while clock < NOW + seconds:
        job = queue.popleft()
        if job == "tinker" and fair:
            with session_scope() as s:
                if trainer_shares.should_yield(s, tinker_id, now=clock):
                    queue.append(job)
                    continue
        cost = op_s if job == "tinker" else step_s
        clock += cost
        used[job] += cost
        trainer_shares.record(tinker_id if job == "tinker" else rl_id, cost, now=clock)
        queue.append(job)  # the client's next op / the run's next step
    return used["tinker"] / (used["tinker"] + used["rl"])


@pytest.mark.parametrize("rl_share, tinker_share", [(1.0, 1.0), (3.0, 1.0), (1.0, 3.0)])
def test_a_tinker_burst_takes_its_share_of_the_trainer_and_no_more(database, redis_db, rl_share, tinker_share):
    tinker_id = _tinker_run(("forward_backward", "pending"), share=tinker_share)
    rl_id = _rl_run("pending", share=rl_share)
    fifo = _simulate(tinker_id, rl_id, fair=False)
    redis_db.flushdb()
    fair = _simulate(tinker_id, rl_id, fair=True)
    share = tinker_share / (tinker_share + rl_share)
    # First in, first out, 16 queued ops of 0.25 s take 4 s per 2 s RL step: 2/3 of the trainer,
    # whatever the shares.  Yielding, the burst gets at most its share (to one op or step; fewer
    # when its queued ops are fewer than its share could use: with share 3 it can use 4 s of 6).
    assert fifo == pytest.approx(2 / 3, abs=0.01)
    assert fair <= share + 0.03
    assert fair >= min(share, 2 / 3) - 0.05


def test_a_tinker_models_share_is_its_keys(database, monkeypatch):
    """create_model writes the key's `share` (TURNSTILE_TINKER_KEYS) as the run's scheduling.share."""
    import json

    from app import config
    from app.tinker import registry

    monkeypatch.setenv("TURNSTILE_TINKER_KEYS", json.dumps({"alice": {"share": 2.5}, "bob": {}}))
    config.reset_settings()
    with session_scope() as s:
        shares = {}
        for key in ("alice", "bob"):
            session = registry.create_session(s, key, sdk_version="0.38.0", tags=[], user_metadata=None)
            model = registry.create_model(s, key, session_id=session.id, seq_id=0, base_model="tiny", rank=8,
                                          seed=None, user_metadata=None)
            shares[key] = s.get(Run, model.run_id).run_config().scheduling.share
    assert shares == {"alice": 2.5, "bob": 1.0}
    monkeypatch.setenv("TURNSTILE_TINKER_KEYS", json.dumps({"alice": {"share": 0}}))
    config.reset_settings()
    with pytest.raises(config.SettingsError, match="TURNSTILE_TINKER_KEYS.*greater than 0"):
        config.get_settings()


def test_redis_down_neither_fails_the_work_nor_blocks_it(database, monkeypatch, caplog):
    from app import config

    me = _tinker_run(("forward_backward", "pending"))
    _rl_run("pending")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    config.reset_settings()
    trainer_shares.record(me, 1.0)  # logged, not raised: the step or op it follows stands
    with session_scope() as s:
        assert not trainer_shares.should_yield(s, me)  # first in, first out, as without shares
    assert "trainer_usage_not_recorded" in caplog.text and "trainer_usage_unread" in caplog.text
