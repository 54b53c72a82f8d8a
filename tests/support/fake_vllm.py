"""A stand-in for the weight-update routes of a dev-mode ``vllm serve``, on a real HTTP server.

Used only where a real vLLM cannot do what a test needs: vLLM's CPU build (tests/vllm) takes
minutes to start on the shared test box, serves the whole session's tests from one process, and
cannot be made to hang or fail a load on cue, nor to lose its reloader half-way, without
breaking the other tests that share it.  The routes answer as vLLM 0.32's do
(``vllm/entrypoints/rl/online/api_router.py`` and ``serve/dev/rpc/api_router.py``):
``POST /pause?mode=&clear_cache=`` → ``{"status": "paused"}``, ``POST /resume`` →
``{"status": "resumed"}`` (a no-op when not paused), ``GET /is_paused`` → ``{"is_paused": bool}``,
``POST /collective_rpc {"method", "args", "timeout"}`` → ``{"results": [...]}``,
``POST /reset_prefix_cache``.  ``pause_routes=False`` serves none of the pause routes (404), as an
older vLLM build.  ``routes`` True/False also answers ``GET /v1/models`` and a
``POST /v1/completions`` whose choice carries (or not) ``routed_experts``, a base64 ``.npy`` of
``[prompt + completion - 1, layers, top_k]`` uint8 ids, as ``vllm serve
--enable-return-routed-experts`` does (its CPU build cannot start with that flag: docs/moe.md).
"""
from __future__ import annotations

import json
import threading

from werkzeug.serving import make_server
from werkzeug.wrappers import Request, Response


class FakeVLLM:
    """The fake on 127.0.0.1 (its own thread); ``url`` is its root.

    ``load``: what ``/collective_rpc`` does: ``"ok"``, ``"fail"`` (answers 500 as vLLM does when
    a worker raises) or ``"hang"`` (blocks until ``release`` is set).  ``resume_failures``: how
    many ``/resume`` calls answer 500 before one succeeds.  ``calls`` lists ``(method, path)`` in
    arrival order, ``rpc_bodies`` the JSON bodies of the loads; ``load_started`` is set once a
    load arrived.
    """

    def __init__(self, *, pause_routes: bool = True, load: str = "ok", resume_failures: int = 0,
                 routes: bool | None = None) -> None:
        self.pause_routes, self.load, self.resume_failures = pause_routes, load, resume_failures
        self.routes = routes
        self.paused = False
        self.pause_params: list[dict] = []
        self.calls: list[tuple[str, str]] = []
        self.rpc_bodies: list[dict] = []
        self.load_started, self.release = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        self._server = make_server("127.0.0.1", 0, self._app, threaded=True)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._thread.join(10)

    def resumes(self) -> int:
        return sum(1 for call in self.calls if call == ("POST", "/resume"))

    def _app(self, environ, start_response):
        request = Request(environ)
        with self._lock:
            self.calls.append((request.method, request.path))
        return self._answer(request)(environ, start_response)

    def _answer(self, request: Request) -> Response:
        route = (request.method, request.path)
        if route[1] in ("/pause", "/resume", "/is_paused") and not self.pause_routes:
            return _json({"detail": "Not Found"}, 404)
        if route == ("POST", "/pause"):
            self.pause_params.append(dict(request.args))
            self.paused = True
            return _json({"status": "paused"})
        if route == ("POST", "/resume"):
            with self._lock:
                if self.resume_failures > 0:
                    self.resume_failures -= 1
                    return _json({"error": "Failed to resume generation: engine core busy"}, 500)
            self.paused = False
            return _json({"status": "resumed"})
        if route == ("GET", "/is_paused"):
            return _json({"is_paused": self.paused})
        if route == ("POST", "/collective_rpc"):
            self.rpc_bodies.append(json.loads(request.get_data() or b"{}"))
            self.load_started.set()
            if self.load == "hang":
                self.release.wait()
            if self.load == "fail":
                return _json({"error": {"message": "turnstile_load_weights: no safetensors in folder"}}, 500)
            return _json({"results": [{"loaded": 1}]})
        if route == ("GET", "/v1/models") and self.routes is not None:
            return _json({"object": "list", "data": [{"id": "fake-moe", "object": "model"}]})
        if route == ("POST", "/v1/completions") and self.routes is not None:
            choice = {"index": 0, "text": "b", "finish_reason": "length"}
            if self.routes:
                import base64
                import io

                import numpy as np

                buf = io.BytesIO()
                np.save(buf, np.array([[[0, 1], [2, 3]]], dtype=np.uint8), allow_pickle=False)
                choice["routed_experts"] = base64.b64encode(buf.getvalue()).decode()
            return _json({"id": "cmpl-1", "object": "text_completion", "model": "fake-moe", "choices": [choice]})
        if route == ("POST", "/reset_prefix_cache"):
            return Response(status=200)
        return _json({"detail": "Not Found"}, 404)


def _json(body: dict, status: int = 200) -> Response:
    return Response(json.dumps(body), status=status, mimetype="application/json")
