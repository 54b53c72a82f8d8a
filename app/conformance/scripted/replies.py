"""The scripted engine's deterministic pieces: token ids, logprobs, the prompt rendering, a reply
planned into token steps, streamed tool-call quirks, and the script state.

Everything is derivable so tests can check ids end to end (see `app.conformance.scripted`):
`encode(render_prompt(body))` are the prompt ids, `plan(reply, body)` the sampled steps,
`logprob(position, token_id)` each sampled token's logprob.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from typing import Any

OFFSET = 3
MODEL = "scripted-tiny"
_DIRECTIVE = re.compile(r"<<script:([A-Za-z0-9_\-=]+)>>")


# --- deterministic pieces (tests import these) ----------------------------------------------


def encode(text: str) -> list[int]:
    """Token ids of `text`: its UTF-8 bytes + OFFSET."""
    return [b + OFFSET for b in text.encode("utf-8")]


def logprob(position: int, token_id: int) -> float:
    """Deterministic logprob (nats, < 0) of the sampled token at `position`."""
    return -(((token_id * 31 + position * 7) % 1000) / 1000.0) - 0.001


def directive(reply: dict) -> str:
    """The inline text that makes the scripted engine answer with `reply`."""
    return "<<script:" + base64.urlsafe_b64encode(json.dumps(reply).encode()).decode() + ">>"


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    out = []
    for p in content or []:
        if isinstance(p, dict):
            out.append(p.get("text") if p.get("type") == "text" else f"<{p.get('type')}>")
    return "".join(x for x in out if x)


def render_prompt(body: dict) -> str:
    """The scripted chat template: what the engine 'sees' for a Chat Completions body."""
    parts = []
    if body.get("tools"):
        parts.append("<|tools|>\n" + json.dumps(body["tools"], sort_keys=True, ensure_ascii=False) + "\n")
    messages = body.get("messages") or []
    cont = bool(body.get("continue_final_message")) and bool(messages)
    for i, m in enumerate(messages):
        role = m.get("role")
        head = f"<|{role}|>" + (f"[{m.get('tool_call_id')}]" if role == "tool" else "") + "\n"
        reasoning = m.get("reasoning") or m.get("reasoning_content")
        text = (f"<think>{reasoning}</think>" if reasoning else "") + _content_text(m.get("content"))
        for tc in m.get("tool_calls") or []:
            fn = tc.get("function") or {}
            # Arguments inserted as sent (raw JSON text), the form the engine samples them in: a
            # tool-call turn re-renders to its sampled ids unless the harness rewrote it.
            text += ('<tool_call>{"name": ' + json.dumps(fn.get("name")) + ', "arguments": '
                     + _args_text(fn.get("arguments")) + "}</tool_call>")
        parts.append(head + text + ("" if cont and i == len(messages) - 1 else "\n"))
    if body.get("add_generation_prompt", True) and not cont:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def _args_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args if args is not None else {}, ensure_ascii=False)


def _schema_value(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return {}
    if schema.get("enum"):
        return schema["enum"][0]
    t = schema.get("type")
    if isinstance(t, list):
        t = t[0]
    if t == "object" or "properties" in schema:
        props = schema.get("properties") or {}
        return {k: _schema_value(v) for k, v in props.items()}
    return {"string": "x", "integer": 0, "number": 0, "boolean": False, "array": []}.get(t, None)


# --- planning a reply into token steps ------------------------------------------------------


def plan(reply: dict, body: dict) -> tuple[list[dict], str, Any]:
    """Reply -> (steps, finish_reason, stop_reason).  Each step: {"text": piece, "delta": dict|None}.

    Concatenated step texts == the sampled text; ids of a step == encode(step text).
    """
    thinking = ((body.get("chat_template_kwargs") or {}).get("enable_thinking", True)) is not False
    rfield = reply.get("reasoning_field", "reasoning")
    steps: list[dict] = []
    reasoning = reply.get("reasoning") or ""
    if reasoning and thinking:
        steps.append({"text": "<think>", "delta": None})
        steps += [{"text": ch, "delta": {rfield: ch}} for ch in reasoning]
        steps.append({"text": "</think>", "delta": None})
    text = reply.get("text")
    if text is None and not reply.get("tool_calls") and not reply.get("refusal") and not reasoning:
        fmt = body.get("response_format") or {}
        if fmt.get("type") == "json_schema":
            text = json.dumps(_schema_value((fmt.get("json_schema") or {}).get("schema")))
        elif fmt.get("type") == "json_object":
            text = "{}"
        else:
            text = "ok"
    text = text or ""
    finish, stop_reason = reply.get("finish_reason"), None
    calls = list(reply.get("tool_calls") or [])
    for stop in body.get("stop") or []:
        if stop and stop in text:
            text, finish, stop_reason, calls = text[:text.index(stop)], "stop", stop, []
    steps += [{"text": ch, "delta": {"content": ch}} for ch in text]
    if reply.get("refusal"):
        steps += [{"text": ch, "delta": {"refusal": ch}} for ch in reply["refusal"]]
    seed = hashlib.sha256(render_prompt(body).encode()).hexdigest()[:8]
    for k, call in enumerate(calls):
        cid = call.get("id") or f"call_{seed}_{k}"
        args = _args_text(call.get("arguments"))
        head = '<tool_call>{"name": ' + json.dumps(call["name"]) + ', "arguments": '
        steps.append({"text": head, "delta": {"tool_calls": [{"index": k, "id": cid, "type": "function",
                                                               "function": {"name": call["name"], "arguments": ""}}]},
                      "call": (k, cid, call["name"])})
        for i in range(0, len(args), 3):
            steps.append({"text": args[i:i + 3], "delta": {"tool_calls": [{"index": k, "function": {
                "arguments": args[i:i + 3]}}]}, "call": (k, cid, call["name"])})
        steps.append({"text": "}</tool_call>", "delta": None, "call": (k, cid, call["name"]), "trailer": True})
    if finish is None:
        finish = "tool_calls" if calls else "stop"
    max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        kept, used = [], 0
        for s in steps:
            n = len(s["text"].encode("utf-8"))
            if used + n > max_tokens:
                finish, stop_reason = "length", None
                break
            kept.append(s)
            used += n
        steps = kept
    return steps, finish, stop_reason


def apply_quirk(steps: list[dict], quirk: str | None) -> list[dict]:
    """Re-shape streamed tool-call deltas the way some servers do."""
    if not quirk:
        return steps
    out, held = [], {}
    for s in steps:
        call = s.get("call")
        if call is None:
            out.append(s)
            continue
        k, cid, name = call
        if s.get("trailer"):
            if quirk == "args_at_end" and held.get(k):
                s = {**s, "delta": {"tool_calls": [{"index": k, "function": {"arguments": held[k]}}]}}
            out.append(s)
            continue
        tc = json.loads(json.dumps(s["delta"]["tool_calls"][0]))
        first = "id" in tc
        if quirk == "no_type":
            tc.pop("type", None)
        elif quirk == "repeat_id":
            tc["id"] = cid
        elif quirk == "same_index":
            tc["index"] = 0
        elif quirk == "args_at_end" and not first:
            held[k] = held.get(k, "") + tc["function"]["arguments"]
            out.append({**s, "delta": None})
            continue
        elif quirk == "args_object":  # arguments as a JSON value, all on the first fragment
            if first:
                raw = "".join(x["text"] for x in steps if x.get("call") == call and not x.get("trailer")
                              and "id" not in x["delta"]["tool_calls"][0])
                tc["function"]["arguments"] = json.loads(raw) if raw else {}
            else:
                out.append({**s, "delta": None})
                continue
        elif quirk == "args_in_header":  # all arguments ride on the chunk carrying id + name
            if first:
                tc["function"]["arguments"] = "".join(
                    x["text"] for x in steps if x.get("call") == call and not x.get("trailer")
                    and "id" not in x["delta"]["tool_calls"][0])
            else:
                out.append({**s, "delta": None})
                continue
        out.append({**s, "delta": {"tool_calls": [tc]}})
    return out


# --- the script state -------------------------------------------------------------------------


class Scripted:
    """Engine state: script, per-episode counters, recent requests (for tests)."""

    def __init__(self, script: dict | None = None, max_model_len: int = 8192, model: str = MODEL,
                 policy_version: int | None = None) -> None:
        self.script = script or {}
        self.max_model_len = max_model_len
        self.model = model
        self.policy_version = policy_version
        self.counters: dict[str, int] = {}
        self.requests: list[dict] = []
        self.aborted: list[dict] = []  # requests whose client closed the connection during a delay
        self.lock = threading.Lock()

    def reply_for(self, body: dict, episode: str | None) -> dict:
        for m in reversed(body.get("messages") or []):
            found = _DIRECTIVE.findall(_content_text(m.get("content")))
            if found:
                return json.loads(base64.urlsafe_b64decode(found[-1]))
        replies = (self.script.get("episodes") or {}).get(episode or "") or self.script.get("default")
        if replies:
            with self.lock:
                n = self.counters.get(episode or "", 0)
                self.counters[episode or ""] = n + 1
            return replies[min(n, len(replies) - 1)]
        return {}
