"""An in-flight weight update (mode `keep`) under a live harness stream, end to end.

Real tiny engine + real gateway (gunicorn) + real openai SDK + SQL.  The stream goes on across
the update without a gap the client can see; its completion row records the version of every
token, run-length encoded, from the engine's own stamps; each token's logprob is the one its
version's weights give; and a call that arrives during the update is not held by the gateway.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
from support.gateway import make_episode
from sqlalchemy import select

from app import db, versions, weight_gate
from app.engines.modeling import build_tiny_model, save_weights
from app.tables import Completion

pytestmark = pytest.mark.slow


def _perturbed(path):
    model = build_tiny_model(seed=0)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_weights(model, path, {"policy_version": 1})
    return model


def _logprobs_under(model, prompt, ids):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(ids)[:, None])[:, 0]


def test_a_stream_spans_a_keep_update_and_every_token_records_its_version(gw, real, tmp_path):
    import httpx
    from openai import OpenAI

    from app.training.weight_sync import push_weights

    engine_url, gateway_url = real
    weight_gate.reset()
    # The module's engine may hold another test's weights and version (tests run in any order):
    # load the base weights as the next version first, so the stream starts from known weights.
    with httpx.Client(base_url=engine_url, timeout=30) as engine:
        v0 = engine.get("/v1/policy_version").json()["policy_version"] + 1
    base = save_weights(build_tiny_model(seed=0), tmp_path / "base", {"policy_version": v0})
    assert push_weights([engine_url], base, v0, mode="wait") == {engine_url: "ok"}
    v1 = v0 + 1
    new = _perturbed(tmp_path / "ckpt")
    episode_id, token = make_episode()
    client = OpenAI(base_url=f"{gateway_url}/v1", api_key=token, max_retries=0, timeout=300)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "count"}],
                                            max_tokens=1200, temperature=1.0, seed=2, stream=True)
    pieces = []
    for chunk in stream:  # the stream runs on the engine once its first token came
        pieces.append(chunk)
        if chunk.choices and chunk.choices[0].delta.content:
            break
    held_before = weight_gate.hold_stats(engine_url)
    sync = push_weights([engine_url], tmp_path / "ckpt", v1, mode="keep", recompute_kv=True)
    arriving: dict = {}
    other_episode, other_token = make_episode()
    other = threading.Thread(target=lambda: arriving.setdefault("out", OpenAI(
        base_url=f"{gateway_url}/v1", api_key=other_token, max_retries=0, timeout=300).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)))
    other.start()
    pieces += list(stream)
    other.join(300)
    assert sync == {engine_url: "ok"}
    assert pieces[-1].choices[0].finish_reason == "length"
    assert weight_gate.hold_stats(engine_url)["requests"] == held_before["requests"]  # keep closes no gate

    with db.session_scope() as s:
        row = s.scalars(select(Completion).where(Completion.episode_id == episode_id)).one()
        late = s.scalars(select(Completion).where(Completion.episode_id == other_episode)).one()
    assert not row.partial and len(row.sampled_ids) == 1200
    assert row.policy_version == v0 and row.kv_versions is None
    assert len(row.policy_versions) == 2 and row.policy_versions[0] == [0, v0] and row.policy_versions[1][1] == v1
    switch = row.policy_versions[1][0]
    assert 0 < switch < 1200
    per_token = versions.expand(row.policy_versions, 1200, None)
    assert per_token == [v0] * switch + [v1] * (1200 - switch)
    lps = torch.tensor(row.logprobs)
    ids = list(row.sampled_ids)
    old_gap = (_logprobs_under(build_tiny_model(0), list(row.prompt_ids), ids[:switch]) - lps[:switch]).abs().max()
    new_gap = (_logprobs_under(new, list(row.prompt_ids), ids)[switch:] - lps[switch:]).abs().max()
    assert old_gap.item() < 1e-3 and new_gap.item() < 1e-3
    assert late.policy_version == v1 and late.policy_versions == [[0, v1]]
    assert "reload_held_ms" not in late.raw_request


@pytest.mark.parametrize("sdk", ["openai", "anthropic"])
def test_an_abort_update_is_a_503_the_sdks_retry_and_the_retry_is_served_by_the_new_weights(gw, real, tmp_path, sdk):
    """Mode `abort`: the engine ends the running call with finish_reason "abort"; the gateway
    answers 503 (OpenAI server_error / Anthropic overloaded_error), which the real openai and
    anthropic SDKs retry on their own; the retry is answered by the new weights and the call's
    row holds the retry, whole, with the new version.  The retry samples deterministically (a seed;
    Anthropic's Messages API has none, so greedy) from the known perturbed weights: unseeded, the tiny model
    sometimes drew its stop token before `max_tokens` and the call ended "stop", not "length"."""
    import httpx

    from app.training.weight_sync import push_weights

    engine_url, gateway_url = real
    engine = httpx.Client(base_url=engine_url, timeout=30)
    version = engine.get("/v1/policy_version").json()["policy_version"]
    _perturbed(tmp_path / "ckpt")
    aborted_before = engine.get("/health").json()["aborted_requests"]
    episode_id, token = make_episode()
    out: dict = {}

    def call() -> None:
        try:
            if sdk == "openai":
                from openai import OpenAI

                answer = OpenAI(base_url=f"{gateway_url}/v1", api_key=token, max_retries=2, timeout=300) \
                    .chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}],
                                             max_tokens=1500, seed=2)
                out["finish"] = answer.choices[0].finish_reason
            else:
                from anthropic import Anthropic

                answer = Anthropic(base_url=gateway_url, api_key=token, max_retries=2, timeout=300) \
                    .messages.create(model="tiny", max_tokens=1500, messages=[{"role": "user", "content": "go"}],
                                     extra_body={"temperature": 0.0})  # SDK 2.x has no keyword for it
                out["finish"] = answer.stop_reason
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["error"] = exc

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 120
    while engine.get("/health").json()["running"] < 1:  # the call is generating on the engine
        assert time.monotonic() < deadline and caller.is_alive(), out
    sync = push_weights([engine_url], tmp_path / "ckpt", version + 1, mode="abort")
    caller.join(300)
    assert sync == {engine_url: "ok"} and "error" not in out, out
    assert out["finish"] in ("length", "max_tokens")
    assert engine.get("/health").json()["aborted_requests"] == aborted_before + 1
    with db.session_scope() as s:
        rows = s.scalars(select(Completion).where(Completion.episode_id == episode_id)).all()
    assert len(rows) == 1 and not rows[0].partial and rows[0].error is None  # the retry replaced the dead try
    assert rows[0].policy_version == version + 1 and len(rows[0].sampled_ids) == 1500
