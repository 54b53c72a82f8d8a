"""Several engines behind one gateway: session-affine routing; the scripted engine's script file
(per-episode reply lists, used by `harness check`)."""
from __future__ import annotations

import json

import httpx
import pytest
from support.gateway import completions, free_port, make_episode, start_engine, start_gateway, stop, wait_http
from support.gateway_calls import APIS, ask

from app.proxy.upstream import Upstream


def test_rendezvous_routing_is_sticky_and_spreads():
    up = Upstream(["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"])
    picks = {ep: up.pick(ep).url for ep in range(300)}
    assert all(up.pick(ep).url == url for ep, url in picks.items())
    counts = {u: list(picks.values()).count(u) for u in set(picks.values())}
    assert len(counts) == 3 and min(counts.values()) > 60
    fewer = Upstream(["http://127.0.0.1:1", "http://127.0.0.1:2"])
    moved = sum(1 for ep, url in picks.items() if url != "http://127.0.0.1:3" and fewer.pick(ep).url != url)
    assert moved == 0  # removing an engine moves only its own sessions


@pytest.fixture(scope="module")
def two_engines(gw_stack, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two")
    script = tmp / "script.json"
    script.write_text(json.dumps({"default": [{"text": "one"}, {"text": "two"}]}))
    p1, p2, gp = free_port(), free_port(), free_port()
    procs = [start_engine(p1, "--script", str(script)), start_engine(p2, "--script", str(script))]
    try:
        for p in (p1, p2):
            wait_http(f"http://127.0.0.1:{p}/health")
        urls = f"http://127.0.0.1:{p1},http://127.0.0.1:{p2}"
        procs.append(start_gateway(gp, gw_stack.db_url, urls, tmp / "gateway.log"))
        wait_http(f"http://127.0.0.1:{gp}/health")
        yield f"http://127.0.0.1:{gp}", [f"http://127.0.0.1:{p1}", f"http://127.0.0.1:{p2}"]
    finally:
        stop(procs)


class _GW:
    def __init__(self, url):
        self.gateway_url = url


def test_sessions_stick_to_one_engine_and_scripts_play_in_order(gw, two_engines):
    gateway, engines = two_engines
    used, expected = set(), set()
    router = Upstream(engines)
    for _ in range(8):
        ep, token = make_episode()
        texts = [ask(_GW(gateway), token, api, api == "anthropic", "hi").text for api in APIS]
        assert texts == ["one", "two", "two", "two"]  # the episode's script, in order, last repeats
        recs = completions(ep)
        assert len({r.engine_id for r in recs}) == 1
        used.add(recs[0].engine_id)
        expected.add(router.pick(ep).url)
        assert recs[0].engine_id == router.pick(ep).url
        seen = [r for e in engines for r in httpx.get(f"{e}/_scripted/requests").json()["requests"]
                if r["headers"].get("X-Turnstile-Episode") == str(ep)]
        assert len(seen) == 4
    assert used == expected  # spread over engines is checked by the unit test above
