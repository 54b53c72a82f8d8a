"""Hostile request bodies for the REST API and the gateway (deterministic for a seed).

Each case is `(method, path, body bytes or None, headers)`.  Bodies are a valid request with one
place replaced by a hostile JSON value written as raw JSON text, so values JSON cannot carry
through `json.dumps` (NaN, Infinity, 5,000-deep nesting, lone surrogates) are included: NUL
characters, ids and counts at and beyond 2**31 / 2**63, 1 MiB strings, wrong types (list/object
where text is expected, text where a number is), plus raw bytes that are not JSON or not UTF-8.
"""
from __future__ import annotations

import json
import random

HOLE = "__FUZZ_HOLE__"

HOSTILE = [
    "[" * 5000 + "]" * 5000,
    '{"a":' * 5000 + "1" + "}" * 5000,
    '"\\u0000"', '"a\\u0000b"', '"\\ud800"', '"\\udfff\\ud800"', "NaN", "Infinity", "-Infinity",
    str(2**31), str(2**31 - 1), str(-(2**31) - 1), str(2**63), str(10**30), "1e308", "-0.0", "1.5",
    json.dumps("x" * (1 << 20)), json.dumps("\u202e" * 1000), json.dumps("😀" * 5000),
    "[]", "{}", "true", "false", "null", "0", "-1", '""', '" "', '"0"',
    '[{"type": "text", "text": ["a"]}]', '{"type": "text", "text": {"a": 1}}', '[["nested"]]', "[null]",
    '[{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "!!"}}]',
    '{"role": "user", "content": "\\u0000"}', '[{"role": "system"}]', '[1, 2, 3]',
]

RAW = [b"", b"{", b"[", b"null", b"\xff\xfe\x00", b'{"a": "\xc3"}', b"not json", b"{}" * 10,
       b'{"messages": NaN}', b"\x00" * 64, b'{"a":1}garbage', b"[" * 100000]


def _with_hole(base: dict, path: list) -> str:
    body = json.loads(json.dumps(base))
    node = body
    for key in path[:-1]:
        if isinstance(node, list):
            key = min(key, len(node) - 1) if node else None
            if key is None:
                return json.dumps(body)
        elif key not in node or not isinstance(node[key], (dict, list)):
            node[key] = {}
        node = node[key]
    last = path[-1]
    if isinstance(node, list):
        if not node:
            node.append(HOLE)
        else:
            node[min(last, len(node) - 1) if isinstance(last, int) else 0] = HOLE
    else:
        node[last] = HOLE
    return json.dumps(body)


def _fill(template: str, value: str) -> bytes:
    return template.replace(f'"{HOLE}"', value, 1).encode("utf-8", "surrogatepass")


def mutated(base: dict, paths: list[list], rng: random.Random) -> bytes:
    """`base` with the value at one of `paths` (keys / list indexes) replaced by a hostile value."""
    return _fill(_with_hole(base, rng.choice(paths)), rng.choice(HOSTILE))


# --- REST API -----------------------------------------------------------------------------------

REST_RUN = {"kind": "eval", "group_size": 1, "simulate": {"episode_median_s": 0.1},
            "scheduling": {"rollout_slots": 1}}
REST_PATHS = [["kind"], ["group_size"], ["task_set"], ["harness"], ["instances"], ["instances", 0], ["steps"],
              ["training"], ["training", "lr"], ["training", "builder"], ["model"], ["model", "name"],
              ["model", "engine_urls"], ["model", "engine_urls", 0], ["budget", "max_turns"], ["priority"],
              ["simulate"], ["simulate", "episode_median_s"], ["scheduling", "rollout_slots"], ["timeouts", "agent_s"],
              ["seed"], ["tasks_per_step"], ["unknown_field"], ["training", "clip_high"], ["model", "checkpoint"]]
IDS = ["1", "0", "-1", str(2**31 - 1), str(2**31), str(2**63), str(10**30), "abc", "%00", "1%00", "1.5", "0x10",
       "%EF%BC%91", "1e3", "%20", "..%2F..%2Fetc", "9" * 400]
QUERIES = ["%00", "running%00", "x" * 5000, "%ff", "'%20OR%201=1", "", "completed", "%C0%80", "NaN", "-1",
           str(10**30), "1e3", "500", "501", "0"]


def rest_cases(n: int = 2000, seed: int = 0) -> list[tuple[str, str, bytes | None, dict]]:
    """`n` hostile requests to every REST route (about 2/3 run-creation bodies, the rest ids and queries)."""
    rng = random.Random(seed)
    json_ct = {"content-type": "application/json"}
    out: list[tuple[str, str, bytes | None, dict]] = []
    while len(out) < n:
        kind = rng.random()
        if kind < 0.6:
            out.append(("POST", "/api/runs", mutated(REST_RUN, REST_PATHS, rng), json_ct))
        elif kind < 0.65:
            ct = rng.choice([json_ct, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"},
                             {}])
            out.append(("POST", "/api/runs", rng.choice(RAW), ct))
        elif kind < 0.85:
            rid = rng.choice(IDS)
            method, path = rng.choice([("GET", "/api/runs/{}"), ("POST", "/api/runs/{}/cancel"),
                                       ("GET", "/api/runs/{}/episodes"), ("GET", "/api/episodes/{}"),
                                       ("GET", "/api/runs/{}/export")])
            out.append((method, path.format(rid), None, {}))
        else:
            q = rng.choice(QUERIES)
            path = rng.choice(["/api/runs?limit={}", "/api/runs/1/episodes?status={}", "/api/runs?limit=5&limit={}",
                               "/api/runs/{}"])
            out.append(("GET", path.format(q), None, {}))
    return out


# --- gateway --------------------------------------------------------------------------------------

GATEWAY_BASE = {
    "anthropic": ("/v1/messages", {"model": "claude-t", "max_tokens": 64,
                                   "system": [{"type": "text", "text": "be brief"}],
                                   "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
    "chat": ("/v1/chat/completions", {"model": "gpt-t", "max_tokens": 64,
                                      "messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("/v1/responses", {"model": "gpt-t", "max_output_tokens": 64, "input": "hi"}),
    "gemini": ("/v1beta/models/gemini-t:generateContent",
               {"contents": [{"role": "user", "parts": [{"text": "hi"}]}], "generationConfig": {"maxOutputTokens": 64}}),
}
GATEWAY_PATHS = {
    "anthropic": [["model"], ["max_tokens"], ["temperature"], ["top_p"], ["top_k"], ["stop_sequences"], ["system"],
                  ["system", 0, "text"], ["messages"], ["messages", 0], ["messages", 0, "role"],
                  ["messages", 0, "content"], ["messages", 0, "content", 0], ["messages", 0, "content", 0, "text"],
                  ["messages", 0, "content", 0, "type"], ["tools"], ["tool_choice"], ["metadata"], ["thinking"],
                  ["stream"], ["metadata", "user_id"]],
    "chat": [["model"], ["max_tokens"], ["max_completion_tokens"], ["temperature"], ["top_p"], ["n"], ["seed"],
             ["stop"], ["messages"], ["messages", 0], ["messages", 0, "role"], ["messages", 0, "content"],
             ["messages", 0, "name"], ["tools"], ["tool_choice"], ["logprobs"], ["top_logprobs"], ["user"],
             ["response_format"], ["stream"], ["stream_options"], ["logit_bias"]],
    "responses": [["model"], ["max_output_tokens"], ["temperature"], ["top_p"], ["input"], ["instructions"],
                  ["tools"], ["tool_choice"], ["reasoning"], ["text"], ["previous_response_id"], ["store"],
                  ["metadata"], ["stream"], ["input", 0], ["include"]],
    "gemini": [["contents"], ["contents", 0], ["contents", 0, "role"], ["contents", 0, "parts"],
               ["contents", 0, "parts", 0], ["contents", 0, "parts", 0, "text"], ["generationConfig"],
               ["generationConfig", "maxOutputTokens"], ["generationConfig", "temperature"],
               ["generationConfig", "topP"], ["generationConfig", "stopSequences"], ["systemInstruction"],
               ["tools"], ["toolConfig"], ["safetySettings"]],
}


def gateway_cases(api: str, n: int, seed: int = 0) -> list[tuple[str, str, bytes | None, dict]]:
    """`n` hostile requests to one API of the gateway; about half ask for a stream."""
    rng = random.Random(f"{api}-{seed}")
    path, base = GATEWAY_BASE[api]
    out: list[tuple[str, str, bytes | None, dict]] = []
    while len(out) < n:
        stream = rng.random() < 0.5
        body = dict(base)
        p = path
        if stream:
            if api == "gemini":
                p = "/v1beta/models/gemini-t:streamGenerateContent?alt=sse"
            else:
                body["stream"] = True
        headers = {"content-type": "application/json"}
        if rng.random() < 0.05:
            out.append(("POST", p, rng.choice(RAW), headers))
        elif rng.random() < 0.03:
            bad_paths = ([p.replace("gemini-t", "%00"), p.replace("gemini-t", "a" * 5000), p + "%00"]
                         if api == "gemini" else [p + "%00", p + "/x" * 50, p.replace("/v1/", "/v1//")])
            out.append(("POST", rng.choice(bad_paths), json.dumps(body).encode(), headers))
        else:
            out.append(("POST", p, mutated(body, GATEWAY_PATHS[api], rng), headers))
    return out


# --- running them -------------------------------------------------------------------------------

GATEWAY_SHAPE = {  # each API's own error body
    "anthropic": lambda b: b["type"] == "error" and isinstance(b["error"]["message"], str),
    "chat": lambda b: isinstance(b["error"]["message"], str) and "type" in b["error"],
    "responses": lambda b: isinstance(b["error"]["message"], str) and "type" in b["error"],
    "gemini": lambda b: isinstance(b["error"]["message"], str) and isinstance(b["error"]["status"], str),
}


def rest_shape(body) -> bool:
    return isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"].get("message"), str)


def run_cases(client, cases, shape, headers: dict | None = None) -> dict:
    """Send `cases` through a Flask test `client`; returns {"statuses": {code: n}, "bad": [(case, status,
    body head)]} where bad lists every 5xx and every error answer that is not JSON in `shape`."""
    statuses: dict[int, int] = {}
    bad = []
    for method, path, body, case_headers in cases:
        resp = client.open(path, method=method, data=body, headers={**case_headers, **(headers or {})})
        data = resp.get_data()
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        ok = resp.status_code < 500
        if resp.status_code >= 400:
            try:
                ok = ok and resp.mimetype == "application/json" and shape(json.loads(data))
            except (ValueError, KeyError, TypeError):
                ok = False
        if not ok:
            bad.append(((method, path[:200], (body or b"")[:200]), resp.status_code, data[:300]))
    return {"statuses": statuses, "bad": bad}
