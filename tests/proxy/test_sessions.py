"""Sessions and capture guarantees: 401 in each API's shape, tokens never stored or forwarded,
partial records on client disconnect, one record per SDK-retried call, safe seq allocation."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from support.gateway import completions, make_episode
from support.gateway_calls import APIS, ask, request_for
from sqlalchemy import select, text

from app import db
from app.conformance.scripted import directive, encode
from app.tables import Completion, Episode
from app.proxy.canonical import Result
from app.proxy.record import Capture, write_completion
from app.proxy.sessions import hash_token, issue_session, resolve_session


UNAUTH = {
    "anthropic": lambda b: b["type"] == "error" and b["error"]["type"] == "authentication_error",
    "chat": lambda b: b["error"]["code"] == "invalid_api_key" and b["error"]["type"] == "invalid_request_error",
    "responses": lambda b: b["error"]["code"] == "invalid_api_key",
    "gemini": lambda b: b["error"]["status"] == "UNAUTHENTICATED" and b["error"]["code"] == 401,
}


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("stream", [False, True])
def test_unknown_and_finished_sessions_get_401_in_the_callers_shape(gw, api, stream):
    ep, token = make_episode()
    for bad in ("not-a-session", "tsk-forged"):
        a = ask(gw, bad, api, stream, "hi")
        assert a.status == 401 and UNAUTH[api](a.body), a.body
    assert ask(gw, token, api, stream, "hi").status == 200
    with db.session_scope() as s:
        s.get(Episode, ep).status = "grading"
    time.sleep(0.3)  # the gateway trusts a resolution for TURNSTILE_GATEWAY_SESSION_CACHE_S (0.2 s here)
    a = ask(gw, token, api, stream, "hi")
    assert a.status == 401 and UNAUTH[api](a.body)
    assert len(completions(ep)) == 1


def test_every_key_location_is_accepted(gw, episode):
    """Bearer, x-api-key, x-goog-api-key and Gemini's ?key= all carry the session token."""
    _, token = episode
    path, body = request_for("gemini", False, "hi")
    for headers, suffix in [({"authorization": f"Bearer {token}"}, ""), ({"x-api-key": token}, ""),
                            ({"x-goog-api-key": token}, ""), ({}, f"?key={token}")]:
        r = httpx.post(gw.gateway_url + path + suffix, json=body, headers=headers)
        assert r.status_code == 200, (headers, r.text)


def test_token_is_stored_hashed_never_recorded_or_forwarded(gw, episode):
    ep, token = episode
    gw.reset_engine()
    for api in APIS:
        assert ask(gw, token, api, api != "chat", "hi " + directive({"text": "x"})).status == 200
    r = httpx.post(gw.gateway_url + "/v1beta/models/g:generateContent?key=" + token,
                   json={"contents": [{"parts": [{"text": "q"}]}]})
    assert r.status_code == 200
    with db.session_scope() as s:
        assert s.get(Episode, ep).session_token_hash == hash_token(token)
        dump = json.dumps([(c.raw_request, c.normalized_request, c.response) for c in
                           s.scalars(select(Completion).where(Completion.episode_id == ep))])
    assert token not in dump and "<redacted>" in dump
    with db.get_engine().connect() as conn:  # nowhere in the database, in any column
        for table in ("episodes", "completions"):
            for row in conn.execute(text(f"SELECT * FROM {table}")):
                assert token not in repr(row)
    upstream = gw.engine_requests()
    assert len(upstream) >= 5  # one per call (plus clamp retries)
    assert token not in json.dumps(upstream)


def test_resolve_session_and_reissue(gw):
    ep, token = make_episode()
    assert resolve_session(token) == ep
    assert resolve_session(token + "x") is None and resolve_session(None) is None
    with db.session_scope() as s:
        token2 = issue_session(s, ep)
    assert token2 != token and resolve_session(token2) == ep
    with pytest.raises(LookupError):
        with db.session_scope() as s:
            issue_session(s, 10**9)


def test_the_session_cache_is_bounded(gw, monkeypatch):
    """A gateway worker's cache of resolved keys holds at most MAX_CACHED_SESSIONS, newest kept."""
    from app.proxy import sessions

    monkeypatch.setattr(sessions, "MAX_CACHED_SESSIONS", 3)
    sessions.forget(None)
    tokens = [make_episode()[1] for _ in range(5)]
    for token in tokens:
        assert sessions.resolve_session(token) is not None
    assert len(sessions._cache) == 3
    assert list(sessions._cache) == [sessions.hash_token(t) for t in tokens[2:]]
    sessions.forget(None)


@pytest.mark.parametrize("api", APIS)
def test_client_disconnect_mid_stream_leaves_a_partial_record(gw, api):
    ep, token = make_episode()
    full = "abcdefghijklmnopqrstuvwxyz" * 4
    path, body = request_for(api, True, "x " + directive({"text": full, "token_delay": 0.03}))
    headers = {"x-api-key": token, "anthropic-version": "2023-06-01", "authorization": f"Bearer {token}",
               "x-goog-api-key": token}
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", gw.gateway_url + path, json=body, headers=headers) as resp:
            got = b""
            for chunk in resp.iter_raw():
                got += chunk
                if got.count(b"\n\n") >= 6:
                    break  # leave mid-answer
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not completions(ep):
        time.sleep(0.1)
    [rec] = completions(ep)
    assert rec.partial is True and "disconnected" in rec.error
    assert 0 < len(rec.sampled_ids) < len(full)
    assert rec.sampled_ids == encode(full)[:len(rec.sampled_ids)]
    assert len(rec.logprobs) == len(rec.sampled_ids) and rec.prompt_ids


@pytest.mark.parametrize("which", ["openai", "anthropic"])
def test_sdk_retry_gives_one_record(gw, sdk, which):
    """The first attempt outlives the SDK's timeout (the gateway still records it); the SDK retries
    the same body; the retry overwrites the first record: one row, the retry's answer."""
    ep, token = make_episode()
    reply = {"text": "retried ok", "slow_first": 1.5}
    msg = [{"role": "user", "content": "x " + directive(reply)}]
    if which == "openai":
        client = sdk.openai(token, timeout=0.8, max_retries=2)
        out = client.chat.completions.create(model="m", messages=msg).choices[0].message.content
    else:
        client = sdk.anthropic(token, timeout=0.8, max_retries=2)
        out = client.messages.create(model="claude-x", max_tokens=50, messages=msg).content[0].text
    assert out == "retried ok"
    time.sleep(1.5)  # let the slow first attempt finish and write
    [rec] = completions(ep)
    assert rec.partial is False and rec.sampled_ids == encode("retried ok")
    assert int({k.lower(): v for k, v in rec.raw_request["headers"].items()}["x-stainless-retry-count"]) >= 1


def test_concurrent_calls_of_one_episode_get_distinct_seqs(gw):
    ep, token = make_episode()
    results = []

    def one(i):
        a = ask(gw, token, "chat", i % 2 == 0, f"call {i} " + directive({"text": f"r{i}"}))
        results.append(a.status)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 16
    recs = completions(ep)
    assert sorted(r.seq for r in recs) == list(range(16))
    assert len({r.request_key for r in recs}) == 16


def _capture(ep: int, key: str, received_at: float = 0.0) -> Capture:
    return Capture(episode_id=ep, api="chat", model="m", stream=False, request_key=key,
                   raw_request={"body": {}, "received_at": received_at}, normalized_request={"messages": []},
                   policy_version_fallback=3)


def test_record_seq_allocation_under_threads_sqlite_and_postgres(any_database):
    """write_completion on real SQLite and PostgreSQL: 24 concurrent writers, 20 distinct calls plus
    4 dead tries (partial) of one key -> seqs 0..20 without gaps or collisions, the tries merged
    into one row holding the newest try."""
    ep, _ = make_episode()
    r = Result(prompt_ids=[1, 2], sampled_ids=[3], logprobs=[-0.5], finish_reason="stop")
    errors = []

    def w(key, n):
        try:
            write_completion(_capture(ep, key, float(n)), r, {"ok": 1}, "id", partial=key == "dup")
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    keys = [f"k{i}" for i in range(20)] + ["dup"] * 4
    threads = [threading.Thread(target=w, args=(k, n)) for n, k in enumerate(keys)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    recs = completions(ep)
    assert sorted(c.seq for c in recs) == list(range(21))
    assert {c.policy_version for c in recs} == {3} and recs[0].logprobs == [-0.5]
    [dup] = [c for c in recs if c.request_key == "dup"]
    assert dup.raw_request["received_at"] == len(keys) - 1
