"""The fuzz case loop shared by `tests/e2e/test_fuzz.py` (a 400-body sample) and `bench/fuzz.py` (the
full corpus): each gateway API gets its own running episode and session token, and its cases
(`support.fuzz_corpus.gateway_cases`) go through the in-process gateway with that API's own auth
headers, as its SDK sends them."""
from __future__ import annotations

from dataclasses import dataclass

from app import db
from app.proxy.sessions import issue_session
from app.tables import Episode, Run, TaskInstance
from support.fuzz_corpus import GATEWAY_SHAPE, gateway_cases, run_cases

GATEWAY_APIS = ("anthropic", "chat", "responses", "gemini")


@dataclass
class GatewayFuzz:
    """One API's fuzz: its episode, the auth headers used, and `run_cases`' report
    ({"statuses": {code: n}, "bad": [...]})."""

    api: str
    episode_id: int
    auth: dict
    report: dict


def api_session(api: str) -> tuple[int, dict]:
    """A running episode of a new collect run with a session token: (episode id, `api`'s auth
    headers carrying the token: Anthropic's x-api-key, Gemini's x-goog-api-key, else a Bearer)."""
    with db.session_scope() as s:
        run = Run(kind="collect", config={})
        s.add(run)
        s.flush()
        ti = TaskInstance(task_set="t", instance_id=f"fuzz-{api}", repo="r", record={})
        s.add(ti)
        s.flush()
        ep = Episode(run_id=run.id, instance_id=ti.id, group_index=0, sample_index=0, status="running")
        s.add(ep)
        s.flush()
        episode_id, token = ep.id, issue_session(s, ep.id)
    auth = {"anthropic": {"x-api-key": token, "anthropic-version": "2023-06-01"},
            "gemini": {"x-goog-api-key": token}}.get(api, {"authorization": f"Bearer {token}"})
    return episode_id, auth


def fuzz_gateway_api(client, api: str, n: int, seed: int = 0) -> GatewayFuzz:
    """Send `n` hostile bodies for `api` (`gateway_cases(api, n, seed)`) through the gateway's Flask
    test `client`, authenticated as a fresh episode of its own (`api_session`)."""
    episode_id, auth = api_session(api)
    report = run_cases(client, gateway_cases(api, n, seed=seed), GATEWAY_SHAPE[api], auth)
    return GatewayFuzz(api, episode_id, auth, report)
