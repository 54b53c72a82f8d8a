"""The scripted engine's HTTP server: `GET /v1/models`, `/health`, `/_scripted/requests`,
`/_scripted/aborted`; `POST /tokenize`, `/_scripted/reset` and (via `ChatRoute`)
`/v1/chat/completions`.  `serve()` starts one in a background thread; `main()` is the CLI
(`python -m app.conformance.scripted`).
"""
from __future__ import annotations

import argparse
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from app.conformance.scripted.chat import ChatRoute
from app.conformance.scripted.replies import MODEL, Scripted, encode, render_prompt


class Handler(ChatRoute, BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "ScriptedServer"

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, *args) -> None:  # quiet
        pass

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        st = self.server.state
        if self.path.startswith("/v1/models"):
            body = {"object": "list", "data": [{"id": st.model, "object": "model", "owned_by": "turnstile-scripted",
                                                "max_model_len": st.max_model_len}]}
            self._json(200, body)
        elif self.path.startswith("/_scripted/requests"):
            with st.lock:
                self._json(200, {"requests": list(st.requests)})
        elif self.path.startswith("/_scripted/aborted"):
            with st.lock:
                self._json(200, {"aborted": list(st.aborted)})
        elif self.path.startswith("/health"):
            self._json(200, {"status": "ok"})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "NotFoundError", "code": 404}})

    def do_POST(self) -> None:
        st = self.server.state
        n = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(n)
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return self._json(400, {"error": {"message": "invalid JSON", "type": "BadRequestError", "code": 400}})
        if self.path.startswith("/_scripted/reset"):
            with st.lock:
                st.requests.clear()
                st.counters.clear()
                st.aborted.clear()
            return self._json(200, {"ok": True})
        with st.lock:
            st.requests.append({"path": self.path, "headers": dict(self.headers.items()), "body": body})
            del st.requests[:-200]
        if self.path.startswith("/tokenize"):
            text = render_prompt(body) if "messages" in body else str(body.get("prompt", ""))
            ids = encode(text)
            return self._json(200, {"count": len(ids), "max_model_len": st.max_model_len, "tokens": ids})
        if not self.path.startswith("/v1/chat/completions"):
            return self._json(404, {"error": {"message": f"no route {self.path}", "type": "NotFoundError",
                                              "code": 404}})
        if body.get("model") != st.model:
            return self._json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                              "type": "NotFoundError", "code": 404}})
        self.complete(body)


class ScriptedServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def handle_error(self, request, client_address) -> None:
        import sys
        if isinstance(sys.exc_info()[1], (ConnectionError, BrokenPipeError)):
            return  # clients closing idle keep-alive connections
        super().handle_error(request, client_address)

    def __init__(self, addr, state: Scripted) -> None:
        self.state = state
        super().__init__(addr, Handler)


def serve(port: int, host: str = "127.0.0.1", **kwargs) -> ScriptedServer:
    """Start a scripted engine in a background thread (for in-process use); returns the server."""
    srv = ScriptedServer((host, port), Scripted(**kwargs))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def main(argv: list[str] | None = None) -> None:
    from app.config import get_settings

    ap = argparse.ArgumentParser(description="Turnstile scripted engine (deterministic; engine contract)")
    ap.add_argument("--port", type=int, default=8200)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--script", default=get_settings().engine_script,
                    help='JSON file {"default": [reply...], "episodes": {"<episode id>": [reply...]}} '
                         '(default: TURNSTILE_SCRIPT)')
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--policy-version", type=int, default=None)
    args = ap.parse_args(argv)
    script = json.load(open(args.script)) if args.script else None
    srv = ScriptedServer((args.host, args.port), Scripted(script, args.max_model_len, args.model,
                                                           args.policy_version))
    print(f"scripted engine on http://{args.host}:{args.port} model={args.model}", flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
