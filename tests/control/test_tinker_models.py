"""A Tinker model's run ends once its client's session is silent and nothing is in flight; while
it runs, it is a LoRA tenant that a full fine-tune may not displace (app.control.tenancy)."""
from __future__ import annotations

import datetime as dt

from sqlalchemy import update

from app.control import tinker_futures, tinker_models
from app.control.tenancy import engine_problems
from app.db import session_scope
from app.runconfig import RunConfig
from app.tables import Run, TinkerModel, TinkerSession, utcnow


def _model(heartbeat_age_s: float) -> tuple[int, str]:
    cfg = RunConfig.model_validate({"kind": "tinker", "model": {"name": "tiny"}, "steps": 0,
                                    "training": {"lora": True, "lora_r": 8}})
    with session_scope() as s:
        run = Run(kind="tinker", status="running", config=cfg.model_dump(mode="json"))
        s.add(run)
        s.flush()
        sess = TinkerSession(id=f"session-{run.id}", key_name="alice", sdk_version="0.38.0", tags=[],
                             user_metadata={}, heartbeat_at=utcnow() - dt.timedelta(seconds=heartbeat_age_s))
        s.add(sess)
        s.flush()
        s.add(TinkerModel(id=f"tinker-{run.id}", run_id=run.id, session_id=sess.id, seq_id=0, key_name="alice",
                          base_model="tiny", lora_rank=8))
        return run.id, f"tinker-{run.id}"


def _status(run_id: int) -> str:
    with session_scope() as s:
        return s.get(Run, run_id).status


def test_runs_end_when_the_session_is_silent_and_nothing_is_in_flight(database):
    silent, silent_model = _model(300)
    busy, busy_model = _model(300)
    alive, _ = _model(5)
    with session_scope() as s:
        fid = tinker_futures.create(s, model_id=busy_model, request_id="r1", op="optim_step", payload={},
                                    key_name="alice").id
    with session_scope() as s:
        assert tinker_models.finish_idle(s, utcnow(), session_timeout_s=120) == [silent]
    assert (_status(silent), _status(busy), _status(alive)) == ("completed", "running", "running")
    with session_scope() as s:
        tinker_futures.complete(s, fid, {"metrics": {}})
    with session_scope() as s:
        assert tinker_models.finish_idle(s, utcnow(), session_timeout_s=120) == [busy]
        assert tinker_models.finish_idle(s, utcnow(), session_timeout_s=120) == []  # once


def test_a_running_tinker_model_holds_the_engines_against_a_full_fine_tune(database):
    run_id, _ = _model(0)
    full = RunConfig(kind="train")
    problems = engine_problems(full)
    assert problems and problems[0][0] == "training.lora" and f"LoRA train run(s) {run_id}" in problems[0][1]
    with session_scope() as s:
        s.execute(update(Run).where(Run.id == run_id).values(status="completed"))
    assert engine_problems(full) == []


def test_a_finished_session_ends_its_models_without_waiting_for_silence(database):
    finished, _ = _model(0)
    other, _ = _model(0)
    with session_scope() as s:
        for run_id in (finished, other):
            s.get(TinkerSession, f"session-{run_id}").finished_at = utcnow()
    with session_scope() as s:  # only the session asked for when one is named
        assert tinker_models.finish_idle(s, utcnow(), session_timeout_s=120, session_id=f"session-{finished}") \
            == [finished]
    assert (_status(finished), _status(other)) == ("completed", "running")
    with session_scope() as s:
        assert tinker_models.finish_idle(s, utcnow(), session_timeout_s=120) == [other]
