"""A weight update during live streams causes no client-visible error (issue 8).

Real tiny engine + real gateway (gunicorn) + real openai SDK.  Streams already running
when the engine swaps weights finish on the old weights with the old version stamp; calls
that arrive while the trainer's reload gate is closed are held by the gateway (streams get
keep-alives) and then answered by the new weights with the new version stamp.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
from support import wait_for
from support.gateway import make_episode
from sqlalchemy import select

from app import db, weight_gate
from app.tables import Completion

pytestmark = pytest.mark.slow


def _perturbed_checkpoint(path) -> None:
    from app.engines.modeling import build_tiny_model, save_weights

    model = build_tiny_model(seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_weights(model, path)


def test_reload_during_live_streams_is_invisible_to_clients(gw, real, tmp_path):
    from openai import OpenAI

    from app.training.weight_sync import push_weights

    engine_url, gateway_url = real
    weight_gate.reset()
    _perturbed_checkpoint(tmp_path / "ckpt")
    errors: list[BaseException] = []
    results: dict[str, tuple[int, str]] = {}
    started = {f"live{i}": threading.Event() for i in range(3)}
    sending = {f"held{i}": threading.Event() for i in range(3)}

    def call(name: str, stream: bool) -> None:
        episode_id, token = make_episode()
        client = OpenAI(base_url=f"{gateway_url}/v1", api_key=token, max_retries=0, timeout=120)
        try:
            kwargs = dict(model="tiny", messages=[{"role": "user", "content": f"count for {name}"}],
                          max_tokens=48, temperature=1.0, seed=1)
            if name in sending:
                sending[name].set()  # the call leaves now (a loaded box may start threads late)
            if stream:
                text = ""
                for ch in client.chat.completions.create(stream=True, **kwargs):
                    if name in started:
                        started[name].set()  # this stream is running on the engine
                    text += (ch.choices[0].delta.content or "") if ch.choices else ""
            else:
                text = client.chat.completions.create(**kwargs).choices[0].message.content
            results[name] = (episode_id, text)
        except BaseException as exc:  # noqa: BLE001 - any client-visible failure fails the test
            errors.append(exc)

    live = [threading.Thread(target=call, args=(f"live{i}", True)) for i in range(3)]
    for t in live:
        t.start()
    for name, event in started.items():  # the live streams are generating
        assert event.wait(60), f"{name} did not start"
    held = []
    holding = weight_gate.hold_stats(engine_url)["holding"]
    with weight_gate.reloading(engine_url, 1):  # what push_weights does around the engine's reload
        # A gateway process trusts its last read of the gate for CACHE_S: a call inside that window
        # goes on to the engine, which holds it itself.  These calls must meet the closed gate.
        time.sleep(weight_gate.CACHE_S + 0.1)
        for i, stream in enumerate((True, False, True)):
            t = threading.Thread(target=call, args=(f"held{i}", stream))
            t.start()
            held.append(t)
        for name, event in sending.items():
            assert event.wait(60), f"{name} was not sent"
        # A loaded box may deliver the calls late: keep the gate closed until the gateway holds all three.
        wait_for(lambda: weight_gate.hold_stats(engine_url)["holding"] - holding == 3, timeout=60,
                 interval=0.05, what=lambda: f"3 held calls; hold stats {weight_gate.hold_stats(engine_url)}")
        time.sleep(1.0)  # a slow reload: the new calls must wait at the gateway, not fail
        sync = push_weights([engine_url], tmp_path / "ckpt", 1, mode="wait")  # the engine loads the new weights
    for t in live + held:
        t.join(timeout=180)
    assert not errors, errors
    assert sync == {engine_url: "ok"}
    assert len(results) == 6
    with db.session_scope() as s:
        rows = {name: s.scalars(select(Completion).where(Completion.episode_id == results[name][0])).one()
                for name in results}
    for name, row in rows.items():
        assert not row.partial and row.sampled_ids and row.error is None, name
        if name.startswith("held"):
            assert row.raw_request["reload_held_ms"] >= 1000, (name, row.raw_request.get("reload_held_ms"))
            assert row.policy_version == 1, name  # answered by the new weights
        else:
            assert "reload_held_ms" not in row.raw_request
    stats = weight_gate.hold_stats(engine_url)
    assert stats["requests"] >= 3 and stats["seconds"] >= 3.0
    assert stats["holding"] == holding  # every held call was let go


def test_a_client_that_leaves_a_held_stream_is_counted_held_and_then_let_go(gw, real):
    """The gateway holds a stream while the gate is closed (keep-alives every 0.3 s here); the
    client hangs up; the next keep-alive write fails, the stream is closed, and the hold counts
    as one held request whose count of held-now is given back."""
    import httpx

    engine_url, gateway_url = real
    weight_gate.reset()
    before = weight_gate.hold_stats(engine_url)
    _episode_id, token = make_episode()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
    with weight_gate.reloading(engine_url, 7):
        time.sleep(weight_gate.CACHE_S + 0.1)  # past the gateway's cached read of the open gate
        with httpx.Client(timeout=30) as client, client.stream(
                "POST", f"{gateway_url}/v1/chat/completions", json=body,
                headers={"Authorization": f"Bearer {token}"}) as resp:
            assert resp.status_code == 200
            next(resp.iter_raw())  # the opening frames came: the call waits at the gateway
            wait_for(lambda: weight_gate.hold_stats(engine_url)["holding"] == before["holding"] + 1, timeout=30,
                     interval=0.05, what=lambda: f"the call to be held; {weight_gate.hold_stats(engine_url)}")
        # the client is gone while the gate is still closed
        wait_for(lambda: weight_gate.hold_stats(engine_url)["holding"] == before["holding"], timeout=30,
                 interval=0.05, what=lambda: f"the departed call to be let go; {weight_gate.hold_stats(engine_url)}")
    after = weight_gate.hold_stats(engine_url)
    assert after["requests"] == before["requests"] + 1 and after["seconds"] > before["seconds"]
