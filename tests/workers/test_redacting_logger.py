"""The gateway's access log (gunicorn, TURNSTILE_GATEWAY_ACCESS_LOG) never shows a session key."""
from __future__ import annotations

import httpx
import pytest
from support.gateway_calls import auth_headers
from support.gateway import free_port, start_gateway, stop, wait_http

from workers.redacting_logger import redact_query


@pytest.mark.parametrize("raw, redacted", [
    ("key=abc", "key=<redacted>"),
    ("alt=sse&key=abc&x=1", "alt=sse&key=<redacted>&x=1"),
    ("POST /v1beta/models/m:generateContent?key=s3cr3t HTTP/1.1",
     "POST /v1beta/models/m:generateContent?key=<redacted> HTTP/1.1"),
    ("monkey=1&KEY=abc", "monkey=1&KEY=<redacted>"),
    ("", ""),
])
def test_query_credentials_are_redacted(raw, redacted):
    assert redact_query(raw) == redacted


def test_gemini_query_key_and_headers_stay_out_of_the_access_log(gw, episode, tmp_path):
    _, token = episode
    port = free_port()
    access = tmp_path / "access.log"
    proc = start_gateway(port, gw.db_url, gw.engine_url, tmp_path / "gateway.log",
                         TURNSTILE_GATEWAY_ACCESS_LOG=str(access))
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        body = {"contents": [{"parts": [{"text": "hi"}]}]}
        r = httpx.post(f"http://127.0.0.1:{port}/v1beta/models/gemini-x:generateContent?key={token}", json=body)
        assert r.status_code == 200, r.text
        r = httpx.post(f"http://127.0.0.1:{port}/chat/completions", headers=auth_headers("chat", token),
                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    finally:
        stop([proc])
    log = access.read_text()
    assert "generateContent?key=<redacted>" in log and "/chat/completions" in log
    assert token not in log
