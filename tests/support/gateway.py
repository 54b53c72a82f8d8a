"""Helpers of the gateway tests: subprocess servers, episodes with session tokens, records,
and SDK clients that keep a copy of every SSE stream for the grammar validators."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.config import ROOT

import httpx

from app import db
from app.tables import Completion, Episode, Run, TaskInstance
from support.gateway_grammar import VALIDATORS, api_of_path
from support import free_port as free_port  # re-exported for the gateway tests


def wait_http(url: str, timeout: float = 120.0) -> None:
    """Until `url` answers below 500; a gateway worker imports the app first (10 s on a loaded 2-core box)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


@dataclass
class Stack:
    db_url: str
    engine_url: str
    gateway_url: str
    procs: list = field(default_factory=list)
    worker_class: str | None = None  # the gateway's gunicorn worker class (None: the default)

    def engine_requests(self) -> list[dict]:
        return httpx.get(f"{self.engine_url}/_scripted/requests").json()["requests"]

    def reset_engine(self) -> None:
        httpx.post(f"{self.engine_url}/_scripted/reset", json={})


def start_engine(port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "app.conformance.scripted", "--port", str(port), *extra],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_gateway(port: int, db_url: str, engine_urls: str, log_path: Path, worker_class: str | None = None,
                  **env) -> subprocess.Popen:
    """The gateway under gunicorn (`workers/gateway_conf.py`), with `worker_class` (gthread or
    gevent; None: the configured default)."""
    if worker_class:
        env["TURNSTILE_GATEWAY_WORKER_CLASS"] = worker_class
    e = dict(os.environ, DATABASE_URL=db_url, TURNSTILE_ENGINE_URLS=engine_urls,
             TURNSTILE_GATEWAY_BIND=f"127.0.0.1:{port}", TURNSTILE_GATEWAY_WORKERS="2",
             TURNSTILE_GATEWAY_THREADS="16", TURNSTILE_GATEWAY_KEEPALIVE_S="0.3",
             TURNSTILE_GATEWAY_SESSION_CACHE_S="0.2", TURNSTILE_GATEWAY_MAX_BODY_BYTES=str(4 * 1024 * 1024), **env)
    return subprocess.Popen([str(ROOT / ".venv/bin/gunicorn"), "-c", "workers/gateway_conf.py",
                             "app.proxy:create_gateway_app()"], cwd=ROOT, env=e,
                            stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)


def stop(procs) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def make_episode(status: str = "running") -> tuple[int, str]:
    from app.proxy.sessions import issue_session
    with db.session_scope() as s:
        run = Run(kind="collect", config={}, policy_version=7)
        s.add(run)
        s.flush()
        ti = TaskInstance(task_set="t", instance_id=f"x{time.monotonic_ns()}", repo="r", record={})
        s.add(ti)
        s.flush()
        ep = Episode(run_id=run.id, instance_id=ti.id, group_index=0, sample_index=0, status=status)
        s.add(ep)
        s.flush()
        return ep.id, issue_session(s, ep.id)


def completions(episode_id: int) -> list[Completion]:
    with db.session_scope() as s:
        return list(s.query(Completion).filter(Completion.episode_id == episode_id).order_by(Completion.seq))


def recording_transport(hx, streams: list):
    """An `hx` (httpx or httpx2: the openai/anthropic SDKs use httpx2) transport that passes requests
    through and keeps a copy of every SSE response body in `streams` as (path, bytearray)."""

    class Tee(hx.SyncByteStream):
        def __init__(self, inner, buf):
            self.inner, self.buf = inner, buf

        def __iter__(self):
            for chunk in self.inner:
                self.buf.extend(chunk)
                yield chunk

        def close(self):
            self.inner.close()

    class Recording(hx.BaseTransport):
        def __init__(self):
            self.inner = hx.HTTPTransport()

        def handle_request(self, request):
            resp = self.inner.handle_request(request)
            if not resp.headers.get("content-type", "").startswith("text/event-stream"):
                return resp
            buf = bytearray()
            streams.append((request.url.path, buf))
            return hx.Response(resp.status_code, headers=resp.headers, stream=Tee(resp.stream, buf),
                               extensions=resp.extensions)

        def close(self):
            self.inner.close()

    return Recording()


class SDKs:
    """Factories for real SDK clients pointed at the gateway, all recording their streams."""

    def __init__(self, base: str) -> None:
        import httpx2
        self.base = base
        self.streams: list[tuple[str, bytearray]] = []
        self.http = httpx2.Client(transport=recording_transport(httpx2, self.streams), timeout=30)

    def openai(self, token: str, **kw):
        import openai
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=token, http_client=self.http, **kw)

    def anthropic(self, token: str, **kw):
        import anthropic
        return anthropic.Anthropic(base_url=self.base, api_key=token, http_client=self.http, **kw)

    def gemini(self, token: str):
        from google import genai
        from google.genai import types
        return genai.Client(api_key=token, http_options=types.HttpOptions(base_url=self.base,
                                                                        httpx_client=self.http))

    def validated(self) -> list[tuple[str, dict]]:
        """Validate every recorded stream; returns (api, rebuilt answer) per stream."""
        out = []
        for path, buf in self.streams:
            api = "gemini" if ":" in path else api_of_path(path)
            out.append((api, VALIDATORS[api](bytes(buf))))
        return out
