"""Token-rate load for `bench/gateway.py --token-rate`: a paced scripted engine and a lean SSE load client.

Engine (`python bench/token_stream.py engine --port P --rate R --tokens N`): an asyncio HTTP/1.1
server speaking the engine contract the gateway needs (`GET /health`, `GET /v1/models`, streamed
and non-stream `POST /v1/chat/completions` with vLLM's `prompt_token_ids` / `token_ids` and
`logprobs`).  Every stream carries N one-character tokens (`x`, id 120), one SSE event each, paced
at R tokens/s per stream by one shared 0.5 ms ticker (so the engine's own CPU stays small and the
gateway, not the engine, is what is measured).  Chunks are pre-rendered bytes.

Client (`run_load`): S concurrent sessions on one asyncio loop, each sending one streamed call after
another for a fixed time (`Connection: close`, so a call's end is the server's EOF), each call's
body its own.  Per call it timestamps every network read and counts the API's text-delta events
in it (`MARKERS`), giving the tokens, the time to the first token and the gaps between tokens (a
read carrying k tokens is one gap then k-1 gaps of 0).  Shapes of the four client APIs' requests
are in `request_for`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

TOKEN_ID = 120  # "x": one byte, one token
PROMPT_IDS = list(range(1000, 1016))

# One text token in each API's SSE output (a substring counted per event).
MARKERS = {
    "chat": b'{"content":"',
    "anthropic": b'"text_delta"',
    "responses": b"event: response.output_text.delta",
    "gemini": b'"parts":[{"text":"',
}


def _chunk(obj: dict) -> bytes:
    data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


def _render(model: str, n: int) -> tuple[bytes, bytes, bytes]:
    """(first chunk, one token chunk, the tail: finish + usage + [DONE] + end of body)."""
    base = {"id": "chatcmpl-tok", "object": "chat.completion.chunk", "created": 0, "model": model}
    first = _chunk({**base, "prompt_token_ids": PROMPT_IDS, "choices": [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
    lp = {"content": [{"token": f"token_id:{TOKEN_ID}", "logprob": -0.25, "bytes": [TOKEN_ID], "top_logprobs": []}]}
    tok = _chunk({**base, "choices": [{"index": 0, "delta": {"content": "x"}, "logprobs": lp, "finish_reason": None,
                                       "token_ids": [TOKEN_ID]}]})
    usage = {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": n, "total_tokens": len(PROMPT_IDS) + n}
    tail = (_chunk({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
                                         "stop_reason": None, "token_ids": []}]})
            + _chunk({**base, "choices": [], "usage": usage}) + _chunk_raw(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    return first, tok, tail


def _chunk_raw(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@dataclass
class _Paced:
    writer: asyncio.StreamWriter
    t0: float
    n: int
    sent: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)


class TokenEngine:
    """The paced engine (see the module docstring)."""

    def __init__(self, rate: float, tokens: int, model: str = "tok-engine") -> None:
        self.rate, self.tokens, self.model = rate, tokens, model
        self.first, self.tok, self.tail = _render(model, tokens)
        self.active: list[_Paced] = []

    async def ticker(self) -> None:
        while True:
            await asyncio.sleep(0.0005)
            if not self.active:
                continue
            now = time.perf_counter()
            keep = []
            for s in self.active:
                due = min(s.n, int((now - s.t0) * self.rate) + 1)
                k = due - s.sent
                if k > 0 and not s.writer.is_closing():
                    s.sent = due
                    s.writer.write(self.tok * k + (self.tail if due >= s.n else b""))
                if s.sent >= s.n or s.writer.is_closing():
                    s.done.set()
                else:
                    keep.append(s)
            self.active = keep

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(hdrs.get("content-length", "0") or 0))
                close = hdrs.get("connection", "").lower() == "close"
                if method == "GET":
                    obj = {"status": "ok"} if path.startswith("/health") else {
                        "object": "list", "data": [{"id": self.model, "object": "model", "max_model_len": 1 << 20}]}
                    data = json.dumps(obj).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(data), data))
                else:
                    req = json.loads(body or b"{}")
                    n = min(self.tokens, int(req.get("max_tokens") or self.tokens))
                    if req.get("stream"):
                        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                     b"transfer-encoding: chunked\r\n\r\n" + (self.first if n == self.tokens
                                                                                else _render(self.model, n)[0]))
                        paced = _Paced(writer, time.perf_counter(), n)
                        self.active.append(paced)
                        await paced.done.wait()
                    else:
                        await asyncio.sleep(n / self.rate)
                        data = json.dumps(self._complete(n)).encode()
                        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                     b"content-length: %d\r\n\r\n%s" % (len(data), data))
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()

    def _complete(self, n: int) -> dict:
        lp = {"token": f"token_id:{TOKEN_ID}", "logprob": -0.25, "bytes": [TOKEN_ID], "top_logprobs": []}
        return {"id": "chatcmpl-tok", "object": "chat.completion", "created": 0, "model": self.model,
                "prompt_token_ids": PROMPT_IDS,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * n},
                             "logprobs": {"content": [lp] * n}, "finish_reason": "stop", "stop_reason": None,
                             "token_ids": [TOKEN_ID] * n}],
                "usage": {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": n,
                          "total_tokens": len(PROMPT_IDS) + n}}


async def _serve(port: int, rate: float, tokens: int) -> None:
    eng = TokenEngine(rate, tokens)
    server = await asyncio.start_server(eng.handle, "127.0.0.1", port, backlog=2048)
    asyncio.get_running_loop().create_task(eng.ticker())
    async with server:
        await server.serve_forever()


# --- the load client ------------------------------------------------------------------------

def request_for(api: str, model: str, max_tokens: int, token: str | None, direct: bool,
                call: int = 0) -> tuple[str, dict, dict]:
    """(path, headers, body) of one streamed call in `api`'s shape (`direct`: the engine's own
    Chat request, as the gateway would send it).  `call` numbers a session's calls: each call's
    body differs, as a harness's do (its conversation grows), so the gateway's record never
    finds earlier tries of the same request (a retry's lookup) that a real session would not have."""
    msg = f"count to a thousand (call {call})"
    if direct:
        return "/v1/chat/completions", {}, {
            "model": model, "messages": [{"role": "user", "content": msg}], "max_tokens": max_tokens,
            "stream": True, "return_token_ids": True, "logprobs": True, "stream_options": {"include_usage": True}}
    auth = {"authorization": f"Bearer {token}"}
    if api == "chat":
        return "/v1/chat/completions", auth, {"model": "m", "messages": [{"role": "user", "content": msg}],
                                              "max_tokens": max_tokens, "stream": True}
    if api == "anthropic":
        return "/v1/messages", {"x-api-key": token, "anthropic-version": "2023-06-01"}, {
            "model": "m", "max_tokens": max_tokens, "stream": True, "messages": [{"role": "user", "content": msg}]}
    if api == "responses":
        return "/v1/responses", auth, {"model": "m", "input": msg, "max_output_tokens": max_tokens, "stream": True}
    if api == "gemini":
        return "/v1beta/models/m:streamGenerateContent?alt=sse", {"x-goog-api-key": token}, {
            "contents": [{"role": "user", "parts": [{"text": msg}]}], "generationConfig": {"maxOutputTokens": max_tokens}}
    raise ValueError(f"unknown api {api!r}")


@dataclass
class Load:
    tokens: int = 0
    calls: int = 0
    errors: int = 0
    seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)


async def _one_call(host: str, port: int, raw: bytes, marker: bytes, load: Load) -> None:
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(raw)
        tail, last, n, first = b"", None, 0, None
        status_ok = None
        while True:
            data = await reader.read(65536)
            if not data:
                break
            now = time.perf_counter()
            if status_ok is None:
                status_ok = data.startswith(b"HTTP/1.1 200")
            buf = tail + data
            k = buf.count(marker)  # a marker split across two reads is counted in the second
            tail = buf[-(len(marker) - 1):] if len(buf) >= len(marker) else buf
            if k:
                if first is None:
                    first = now - t0
                    load.ttft.append(first)
                    load.gaps.extend([0.0] * (k - 1))
                else:
                    load.gaps.append(now - last)
                    load.gaps.extend([0.0] * (k - 1))
                last, n = now, n + k
        load.tokens += n
        load.calls += 1
        if not status_ok or n == 0:
            load.errors += 1
    finally:
        writer.close()


async def _load(url: str, sessions: int, seconds: float, make) -> Load:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    load = Load()
    stop = time.perf_counter() + seconds

    async def session(k: int) -> None:
        call = 0
        while time.perf_counter() < stop:
            path, headers, body = make(k, call)
            data = json.dumps(body).encode()
            head = "".join(f"{a}: {b}\r\n" for a, b in headers.items())
            raw = (f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\nconnection: close\r\n"
                   f"content-length: {len(data)}\r\n{head}\r\n").encode() + data
            call += 1
            try:
                await _one_call(host, int(port), raw, make.marker, load)
            except OSError:
                load.errors += 1
                await asyncio.sleep(0.01)

    t0 = time.perf_counter()
    await asyncio.gather(*(session(k) for k in range(sessions)))
    load.seconds = time.perf_counter() - t0
    return load


def run_load(url: str, sessions: int, seconds: float, make) -> Load:
    """`sessions` concurrent streamed calls for `seconds`; `make(k, i)` -> (path, headers, body) of
    session k's i-th call and `make.marker` the bytes counted as one token."""
    return asyncio.run(_load(url, sessions, seconds, make))


def main() -> None:
    ap = argparse.ArgumentParser(description="paced token engine")
    ap.add_argument("mode", choices=["engine"])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--rate", type=float, default=2000.0, help="tokens/s per stream")
    ap.add_argument("--tokens", type=int, default=200, help="tokens per answer")
    args = ap.parse_args()
    asyncio.run(_serve(args.port, args.rate, args.tokens))


if __name__ == "__main__":
    main()
