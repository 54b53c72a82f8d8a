"""The gateway's access log under its gunicorn config (workers/gateway_conf.py, workers/redacting_logger.py):
a Gemini call's `?key=` and its headers never reach the log."""
from __future__ import annotations

import httpx
from support.gateway_calls import auth_headers
from support.gateway import free_port, start_gateway, stop, wait_http


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
