"""A LoRA train run's sessions sample from its newest adapter on the shared engines; a session that
names another run's adapter is a 400.  (The scripted engine behind the gateway serves no
adapters, so the adapter reaching it shows in its 404.)"""
from __future__ import annotations

import httpx
from support.gateway import make_episode
from support.gateway_calls import auth_headers

from app import db
from app.tables import Episode, Run, TrainingStep

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


def test_a_lora_runs_session_sends_its_adapter_and_refuses_another_runs(gw):
    ep, token = make_episode()
    with db.session_scope() as s:
        run_id = s.get(Episode, ep).run_id
        run = s.get(Run, run_id)
        run.kind, run.config = "train", {"kind": "train", "training": {"lora": True}}
        s.add(TrainingStep(run_id=run_id, step=0, status="completed", episode_ids=[ep],
                           metrics={"adapter": f"run-{run_id}@0123456789ab"}))
    r = httpx.post(gw.gateway_url + "/v1/chat/completions", json={**CHAT, "model": "m"},
                   headers=auth_headers("chat", token))
    # The scripted engine serves no adapters: its 404 names the model the gateway asked it for.
    assert r.status_code == 502 and f"The model `run-{run_id}@0123456789ab` does not exist" in r.text, r.text
    r = httpx.post(gw.gateway_url + "/v1/chat/completions", json={**CHAT, "model": f"run-{run_id + 1}@0123456789ab"},
                   headers=auth_headers("chat", token))
    assert r.status_code == 400 and f"adapter of run {run_id + 1}" in r.text and f"run {run_id}" in r.text


def test_a_sessions_adapter_and_its_version_stamp_come_from_one_step(gw):
    """The run's policy_version (7 here) may already be a newer step's while the session still
    samples the adapter it read: its completions are stamped with that adapter's step version."""
    from app.proxy.sessions import resolve_session_info

    ep, token = make_episode()
    with db.session_scope() as s:
        run = s.get(Run, s.get(Episode, ep).run_id)
        run.kind, run.config = "train", {"kind": "train", "training": {"lora": True}}
        s.add(TrainingStep(run_id=run.id, step=0, status="completed", episode_ids=[ep], policy_version=3,
                           metrics={"adapter": f"run-{run.id}@0123456789ab"}))
        s.add(TrainingStep(run_id=run.id, step=1, status="training", episode_ids=[ep]))
        run_id = run.id
    info = resolve_session_info(token)
    assert (info.adapter, info.policy_version) == (f"run-{run_id}@0123456789ab", 3)
    plain, plain_token = make_episode()  # not a LoRA run: the run's version, as before
    assert resolve_session_info(plain_token).policy_version == 7 and resolve_session_info(plain_token).adapter is None
