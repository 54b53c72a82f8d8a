"""Hostile bodies to the REST API and the gateway: never a 5xx, every error in the caller's API shape.

A sample of `tests/support/fuzz_corpus.py` (nesting 5,000 deep, NUL characters, NaN/Infinity, ids at and
past 2**31, `?status=%00`, 1 MiB strings, wrong types, text given as list/object on streams, raw
bytes) through the in-process apps on PostgreSQL, whose JSONB and integer columns are the strict
ones.  `bench/fuzz.py` sends the full 2,000 bodies per server; these tests send 400 each.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from app import config, create_app, db
from app.tables import Base, Completion
from app.proxy.upstream import reset_upstream
from support.fuzz_corpus import GATEWAY_SHAPE, gateway_cases, rest_cases, rest_shape, run_cases
from support.fuzz_run import GATEWAY_APIS, fuzz_gateway_api
from support import AUTH, ROOT, free_port, wait_for

REDIS_DB = 10
SAMPLE = 400


@pytest.fixture
def pg(pg_url, monkeypatch, redis_db):
    monkeypatch.setenv("DATABASE_URL", pg_url)
    config.reset_settings()
    db.dispose_engine()
    Base.metadata.create_all(db.get_engine())
    yield pg_url
    db.dispose_engine()
    config.reset_settings()


def test_rest_api_fuzz_never_5xx_and_errors_are_json(pg):
    client = create_app().test_client()
    report = run_cases(client, rest_cases(SAMPLE, seed=1), rest_shape, AUTH)
    print("REST", report["statuses"])
    assert report["bad"] == []
    assert report["statuses"].get(400, 0) > SAMPLE // 3  # the corpus is mostly refused, not mostly 404s
    unauth = run_cases(client, rest_cases(50, seed=2), rest_shape)
    assert unauth["bad"] == [] and set(unauth["statuses"]) == {401}


@pytest.fixture
def engine_url():
    """A scripted engine (fast canned answers) for the module's gateway tests."""
    import httpx

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app.conformance.scripted", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, 30, 0.05, "the scripted engine")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture
def scripted_engine(engine_url, monkeypatch):
    monkeypatch.setenv("TURNSTILE_ENGINE_URLS", engine_url)
    monkeypatch.setenv("TURNSTILE_GATEWAY_KEEPALIVE_S", "0.3")
    config.reset_settings()
    reset_upstream()  # the gateway's engine clients are per process: point them at this engine
    yield engine_url
    reset_upstream()


def test_gateway_fuzz_never_5xx_errors_in_the_apis_shape_and_no_record_of_an_error(pg, scripted_engine):
    from app.proxy import create_gateway_app

    client = create_gateway_app().test_client()
    for api in GATEWAY_APIS:
        fuzz = fuzz_gateway_api(client, api, SAMPLE // 4, seed=1)
        print(api, fuzz.report["statuses"])
        assert fuzz.report["bad"] == [], api
        with db.session_scope() as s:
            recorded = s.query(Completion).filter(Completion.episode_id == fuzz.episode_id).count()
        assert recorded <= fuzz.report["statuses"].get(200, 0), api  # an error answer never leaves a record
        no_key = {k: v for k, v in fuzz.auth.items() if k == "anthropic-version"}
        unauth = run_cases(client, gateway_cases(api, 10, seed=2), GATEWAY_SHAPE[api], no_key)
        assert unauth["bad"] == [] and all(code in (400, 401, 404) for code in unauth["statuses"]), api
