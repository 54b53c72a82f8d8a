"""The engine's answer in one canonical form, for streams and non-streams alike.

The engine speaks OpenAI Chat Completions with vLLM's extensions
(https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html).  Servers disagree on details of streamed tool calls and
reasoning, so every upstream answer first passes through this module:

* `ChunkNormalizer.feed(chunk)` turns one upstream stream chunk into canonical
  events, fixing the known quirks once for all four client APIs:
    - reasoning under `reasoning` (new vLLM) or `reasoning_content` (old);
    - tool calls keyed by index; a repeated identical id continues a call, a new
      non-empty id at the same index starts a new one; missing `type`;
      arguments carried in the same chunk as id/name or only at the end.
* `result_from_completion(body)` reads a non-stream answer into the same `Result`.
* `finish_result` recovers a tool call the model wrote inside its reasoning.

Events are tuples:
  ("reasoning", text) | ("text", text) | ("refusal", text)
  ("tool_start", k, call_id, name) | ("tool_args", k, fragment)
where k counts tool calls from 0 in the order they started.

Token accounting comes from the ids (`token_ids`, `prompt_token_ids`), so usage
is identical for the stream and non-stream paths.
"""
from __future__ import annotations

import json
import logging
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from app.engines.route_bytes import routes_from_answer

log = logging.getLogger("turnstile.gateway")


def new_id(prefix: str, n: int = 12) -> str:
    return f"{prefix}{secrets.token_hex(n)}"


@dataclass
class ToolCall:
    """One tool call; `id` is the id clients see, `engine_id` the engine's own when it differs."""

    id: str
    name: str
    arguments: str = ""
    engine_id: str | None = None

    @property
    def eid(self) -> str:
        return self.engine_id or self.id

    def parsed_arguments(self) -> dict:
        """The arguments as a JSON object ({} when empty; {"_raw": text} when not JSON)."""
        if not self.arguments.strip():
            return {}
        try:
            val = json.loads(self.arguments)
        except ValueError:
            return {"_raw": self.arguments}
        return val if isinstance(val, dict) else {"_value": val}


# Engines that number calls per answer (`call_0`) repeat ids across turns, and clients key tool
# results by id, so a repeated id gets a suffix on the way out and loses it on the way back in:
# the engine sees its own ids in the history, and the rendered prompt stays what it sampled.
_UNIQUE_SUFFIX = re.compile(r"^(.+)-gw[0-9a-f]{8}$")


def engine_call_id(client_id: str) -> str:
    """The engine's id of a tool call whose id the gateway made unique (else the id itself)."""
    m = _UNIQUE_SUFFIX.match(client_id) if isinstance(client_id, str) else None
    return m.group(1) if m else client_id


def unique_call_id(engine_id: str, taken: set[str]) -> str:
    """`engine_id`, or a suffixed id when `taken` (ids earlier in the conversation) holds it."""
    return f"{engine_id}-gw{secrets.token_hex(4)}" if engine_id in taken else engine_id


@dataclass
class Result:
    """Everything the engine produced for one call (choice 0).

    finish_reason: OpenAI finish reason (stop | length | tool_calls | content_filter | None);
    stop_reason: vLLM's per-choice stop_reason (matched stop string, stop token id, or None).
    prompt_ids/sampled_ids: int token ids; logprobs: float nats, one per sampled id.
    routed_experts: an MoE engine's chosen experts, int16 [P + S - 1, layers, top_k] (the prompt
    and every sampled token but the last; `take_routes`), None when it sent none.  Recorded
    with the completion, never rendered to the client.
    """

    reasoning: str = ""
    text: str = ""
    refusal: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    prompt_ids: list[int] | None = None
    sampled_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logprobs_content: list[dict] = field(default_factory=list)
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    cached_tokens: int = 0
    policy_version: int | None = None
    # Per-token versions as the engine reported them, run-length encoded (`app.versions`): the
    # weights that sampled each token, and the oldest KV each attended to where that differs.
    policy_versions: list[list[int]] = field(default_factory=list)
    kv_versions: list[list[int]] = field(default_factory=list)
    # For an engine that stamps no versions (vLLM): (first token index, wall-clock arrival) per chunk.
    arrivals: list[tuple[int, float]] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)
    withheld_calls: list[ToolCall] = field(default_factory=list)  # sampled, not shown (`withhold_calls`)
    sampled_finish_reason: str | None = None  # the engine's, when withholding changed `finish_reason`
    routed_experts: np.ndarray | None = None

    @property
    def prompt_tokens(self) -> int:
        if self.prompt_ids is not None:
            return len(self.prompt_ids)
        return self.usage_prompt_tokens or 0

    @property
    def completion_tokens(self) -> int:
        if self.sampled_ids:
            return len(self.sampled_ids)
        return self.usage_completion_tokens or 0

    @property
    def cut_short(self) -> bool:
        """The engine hit the token limit inside a tool call: its last call is unfinished."""
        return self.finish_reason == "length" and bool(self.tool_calls)

    @property
    def runnable_calls(self) -> list[ToolCall]:
        """The tool calls a client may run: all but a call cut off by the token limit."""
        return self.tool_calls[:-1] if self.cut_short else self.tool_calls

    @property
    def stop_sequence(self) -> str | None:
        """The matched stop string (vLLM reports it in `stop_reason`), else None."""
        return self.stop_reason if isinstance(self.stop_reason, str) and self.stop_reason else None


def _reasoning_of(obj: dict) -> str:
    # New vLLM: `reasoning`; old vLLM and DeepSeek: `reasoning_content`.
    return obj.get("reasoning") or obj.get("reasoning_content") or ""


def take_routes(answer: dict, result: Result) -> None:
    """The one place the gateway reads an engine's routed experts: the top-level
    `routed_experts` of a non-stream answer or of the one stream chunk that carries them
    (`app.engines.route_bytes.routes_from_answer`), into `result.routed_experts`.  Malformed
    routes are dropped and flagged (`routed_experts_invalid`): the completion still trains
    without routing replay, never with wrong experts."""
    value = answer.get("routed_experts")
    if value is None:
        return
    try:
        result.routed_experts = routes_from_answer(value)
    except ValueError as exc:
        log.warning("engine sent unusable routed_experts: %s", exc)
        result.flags.append("routed_experts_invalid")


def _logprob_values(lp: Any) -> tuple[list[float], list[dict]]:
    if not isinstance(lp, dict):
        return [], []
    content = lp.get("content") or []
    vals = [float(e.get("logprob", 0.0)) for e in content if isinstance(e, dict)]
    return vals, [e for e in content if isinstance(e, dict)]


def withhold_calls(result: Result, max_calls: int | None) -> None:
    """Show at most `max_calls` tool calls of a finished `result` (None: all).

    The client asked for one call at a time (`parallel_tool_calls: false`, Anthropic's
    `disable_parallel_tool_use`), but engines do not all honour it, so the gateway keeps the first
    call and withholds the others.  Design: the policy's sample is kept whole, never cut:
    `sampled_ids` and `logprobs` stay every token the engine sampled (the withheld calls included),
    so what is trained is exactly what the policy sampled; the calls not shown move to
    `withheld_calls` (recorded in the completion's `normalized_request` as
    `turnstile_withheld_tool_calls`, with the flag `tool_calls_withheld`), the record's
    `finish_reason` stays the engine's (`sampled_finish_reason`) while the client is shown a
    finished call (`finish_reason` "tool_calls", even when the engine stopped for length inside a
    withheld call).  The next turn's prompt still extends the sampled ids: the splice
    (`app.proxy.splice`) recognises the turn the client sends back by what it was shown and
    continues from the recorded sampled ids.  Stopping the engine after the first call instead
    would need the template's end-of-call tokens to cut the ids exactly, which the gateway does
    not know for every model.
    """
    if max_calls is None or len(result.tool_calls) <= max_calls:
        return
    result.withheld_calls = result.tool_calls[max_calls:]
    result.tool_calls = result.tool_calls[:max_calls]
    result.sampled_finish_reason = result.finish_reason
    result.finish_reason = "tool_calls"
    result.flags.append("tool_calls_withheld")


def _shown(events: list[tuple], max_calls: int | None) -> list[tuple]:
    """`events` without those of tool calls past the first `max_calls` (None: all)."""
    if max_calls is None:
        return events
    return [e for e in events if e[0] not in ("tool_start", "tool_args") or e[1] < max_calls]


class ChunkNormalizer:
    """Feeds upstream Chat Completions stream chunks; emits canonical events; builds a `Result`.

    `max_calls`: events of tool calls past the first `max_calls` are not emitted, and `finish()`
    withholds those calls (`withhold_calls`); None shows every call."""

    def __init__(self, taken: set[str] | frozenset = frozenset(), max_calls: int | None = None) -> None:
        self.result = Result()
        self.max_calls = max_calls
        self.taken = set(taken)                 # tool-call ids already in the conversation
        self._by_index: dict[int, int] = {}      # upstream tool index -> k
        self._pending: dict[int, dict] = {}     # k -> {"id","name","args"} before the name is known
        self._started: set[int] = set()
        self.first_chunk_seen = False

    def feed(self, chunk: dict) -> list[tuple]:
        """One parsed `chat.completion.chunk` -> canonical events (possibly none)."""
        r = self.result
        events: list[tuple] = []
        self.first_chunk_seen = True
        if chunk.get("prompt_token_ids") is not None and r.prompt_ids is None:
            r.prompt_ids = list(chunk["prompt_token_ids"])
        if "routed_experts" in chunk:
            take_routes(chunk, r)
        version = chunk.get("policy_version")
        if isinstance(version, int) and not isinstance(version, bool):
            if r.policy_version is None:
                r.policy_version = version
            self._stamp(chunk, version)
        elif chunk.get("choices"):
            r.arrivals.append((len(r.sampled_ids), time.time()))
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            r.usage_prompt_tokens = usage.get("prompt_tokens", r.usage_prompt_tokens)
            r.usage_completion_tokens = usage.get("completion_tokens", r.usage_completion_tokens)
            details = usage.get("prompt_tokens_details") or {}
            r.cached_tokens = int(details.get("cached_tokens") or 0)
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            ids = choice.get("token_ids")
            if ids:
                r.sampled_ids.extend(ids)
            vals, content = _logprob_values(choice.get("logprobs"))
            r.logprobs.extend(vals)
            r.logprobs_content.extend(content)
            delta = choice.get("delta") or {}
            reasoning = _reasoning_of(delta)
            if reasoning:
                r.reasoning += reasoning
                events.append(("reasoning", reasoning))
            if delta.get("content"):
                r.text += delta["content"]
                events.append(("text", delta["content"]))
            if delta.get("refusal"):
                r.refusal += delta["refusal"]
                events.append(("refusal", delta["refusal"]))
            for tc in delta.get("tool_calls") or []:
                events.extend(self._tool_fragment(tc))
            if choice.get("finish_reason"):
                r.finish_reason = choice["finish_reason"]
            if choice.get("stop_reason") is not None:
                r.stop_reason = choice["stop_reason"]
        return _shown(events, self.max_calls)

    def _stamp(self, chunk: dict, version: int) -> None:
        """Extend the per-token version runs by this chunk's sampled tokens: the engine stamps
        each chunk with the version that sampled its tokens (`kv_version` where their KV is older)."""
        r = self.result
        count = sum(len(c.get("token_ids") or []) for c in chunk.get("choices") or [] if c.get("index", 0) == 0)
        if not count:
            return
        kv = chunk.get("kv_version")
        kv = kv if isinstance(kv, int) and not isinstance(kv, bool) else version
        start = len(r.sampled_ids)
        if kv != version and not r.kv_versions:  # the first stale-KV token: earlier ones had their own
            r.kv_versions = [list(run) for run in r.policy_versions]
        if not r.policy_versions or r.policy_versions[-1][1] != version:
            r.policy_versions.append([start, version])
        if r.kv_versions and r.kv_versions[-1][1] != kv:
            r.kv_versions.append([start, kv])
        elif not r.kv_versions and kv != version:
            r.kv_versions.append([start, kv])

    def _tool_fragment(self, tc: dict) -> list[tuple]:
        r = self.result
        fn = tc.get("function") or {}
        call_id = tc.get("id") or ""
        index = tc.get("index")
        if not isinstance(index, int):
            # No index (non-conforming server): continue the last call unless a new id appears.
            last = max(self._by_index, default=None)
            same = last is not None and (not call_id or r.tool_calls[self._by_index[last]].eid == call_id)
            index = last if same else (last + 1 if last is not None else 0)
        k = self._by_index.get(index)
        if k is None or (call_id and r.tool_calls[k].eid != call_id and not r.tool_calls[k].eid.startswith("call_gw")):
            # A new call: first fragment at this index, or a new id reusing the index.
            events_before = self._close_empty(len(r.tool_calls) - 1)
            k = len(r.tool_calls)
            self._by_index[index] = k
            r.tool_calls.append(ToolCall(id=call_id or new_id("call_gw", 8), name=""))
        else:
            events_before = []
        call = r.tool_calls[k]
        if call_id and call.eid.startswith("call_gw"):
            call.id, call.engine_id = call_id, None
        events: list[tuple] = events_before
        if fn.get("name") and not call.name:
            call.name = fn["name"]
        args = fn.get("arguments") or ""
        if not isinstance(args, str):  # some servers send the arguments as a JSON value
            args = json.dumps(args, ensure_ascii=False)
        if k not in self._started:
            if call.name:
                self._started.add(k)
                client_id = unique_call_id(call.id, self.taken)
                self.taken.add(client_id)
                self.taken.add(call.id)
                if client_id != call.id:
                    call.id, call.engine_id = client_id, call.id
                events.append(("tool_start", k, call.id, call.name))
                pending = self._pending.pop(k, "")
                if pending:
                    events.append(("tool_args", k, pending))
            elif args:
                self._pending[k] = self._pending.get(k, "") + args
                call.arguments += args
                return events
        if args:
            call.arguments += args
            if k in self._started:
                events.append(("tool_args", k, args))
        return events

    def _close_empty(self, k: int) -> list[tuple]:
        """Call k is complete: a call with no arguments at all gets "{}", the empty JSON object
        its clients parse (an empty string is not valid JSON)."""
        r = self.result
        if k < 0 or k not in self._started or r.tool_calls[k].arguments.strip():
            return []
        r.tool_calls[k].arguments = "{}"
        return [("tool_args", k, "{}")]

    def finish(self) -> list[tuple]:
        """Call after the last chunk: events for anything recovered from reasoning, in order."""
        r = self.result
        nameless = [c for k, c in enumerate(r.tool_calls) if k not in self._started]
        if nameless:
            r.flags.append("tool_call_without_name")
            r.tool_calls = [c for c in r.tool_calls if c not in nameless]
            self._started = set(range(len(r.tool_calls)))
        events = [] if r.finish_reason == "length" else self._close_empty(len(r.tool_calls) - 1)
        events = _shown(events + finish_result(r), self.max_calls)
        withhold_calls(r, self.max_calls)
        return events


_TOOL_IN_REASONING = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)</function>", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\s]+)>\s*(.*?)\s*</parameter>", re.S)


def _calls_in_reasoning(text: str) -> list[ToolCall]:
    calls = []
    for m in _TOOL_IN_REASONING.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if isinstance(obj, dict) and obj.get("name"):
            args = obj.get("arguments", obj.get("parameters", {}))
            calls.append(ToolCall(new_id("call_", 12), str(obj["name"]),
                                  args if isinstance(args, str) else json.dumps(args)))
    if not calls:
        for m in _XML_FUNCTION.finditer(text):
            params = {k: v for k, v in _XML_PARAM.findall(m.group(2))}
            calls.append(ToolCall(new_id("call_", 12), m.group(1), json.dumps(params)))
    return calls


def finish_result(result: Result) -> list[tuple]:
    """Post-process a finished `Result`; returns events for calls recovered from reasoning.

    vllm-project/vllm#39056: Qwen3.x sometimes writes the tool call inside its
    reasoning; the parser then reports no call and an empty answer.  The record is
    flagged and the call recovered so the agent loop does not end silently.
    """
    events: list[tuple] = []
    if result.logprobs and result.sampled_ids and len(result.logprobs) != len(result.sampled_ids):
        result.flags.append("logprob_count_mismatch")
    if not result.text.strip() and not result.tool_calls and result.reasoning and (
            "<tool_call>" in result.reasoning or "<function=" in result.reasoning):
        calls = _calls_in_reasoning(result.reasoning)
        result.flags.append("tool_call_in_reasoning")
        log.warning("tool call found inside reasoning (%d recovered)", len(calls))
        for call in calls:
            k = len(result.tool_calls)
            result.tool_calls.append(call)
            events.append(("tool_start", k, call.id, call.name))
            if call.arguments:
                events.append(("tool_args", k, call.arguments))
        if calls:
            result.finish_reason = "tool_calls"
    if result.tool_calls and result.finish_reason == "stop" and result.stop_sequence is None:
        result.finish_reason = "tool_calls"
    return events


def result_from_completion(body: dict, taken: set[str] | frozenset = frozenset(),
                           max_calls: int | None = None) -> Result:
    """A non-stream `chat.completion` body (with vLLM extensions) -> `Result` (choice 0), showing at
    most `max_calls` tool calls (`withhold_calls`; None: all)."""
    r = Result()
    if body.get("prompt_token_ids") is not None:
        r.prompt_ids = list(body["prompt_token_ids"])
    if isinstance(body.get("policy_version"), int):
        r.policy_version = body["policy_version"]
    take_routes(body, r)
    for name in ("policy_versions", "kv_versions"):  # the embedded engine's per-token runs
        runs = body.get(name)
        if isinstance(runs, list) and all(isinstance(x, list) and len(x) == 2 for x in runs):
            setattr(r, name, [list(x) for x in runs])
    usage = body.get("usage") or {}
    r.usage_prompt_tokens = usage.get("prompt_tokens")
    r.usage_completion_tokens = usage.get("completion_tokens")
    r.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    choices = body.get("choices") or []
    choice = next((c for c in choices if c.get("index", 0) == 0), choices[0] if choices else {})
    msg = choice.get("message") or {}
    r.reasoning = _reasoning_of(msg)
    r.text = msg.get("content") or ""
    r.refusal = msg.get("refusal") or ""
    for tc in msg.get("tool_calls") or []:
        fn = tc.get("function") or {}
        args = fn.get("arguments")
        if not isinstance(args, str):
            args = json.dumps(args if args is not None else {})
        r.tool_calls.append(ToolCall(tc.get("id") or new_id("call_", 12), fn.get("name") or "", args))
    seen = set(taken)
    for call in r.tool_calls:
        client_id = unique_call_id(call.id, seen)
        seen.update((client_id, call.id))
        if client_id != call.id:
            call.id, call.engine_id = client_id, call.id
    r.finish_reason = choice.get("finish_reason")
    for call in r.runnable_calls:
        if not call.arguments.strip():
            call.arguments = "{}"  # an empty string is not JSON; clients parse the arguments
    r.stop_reason = choice.get("stop_reason")
    r.sampled_ids = list(choice.get("token_ids") or [])
    r.logprobs, r.logprobs_content = _logprob_values(choice.get("logprobs"))
    finish_result(r)
    withhold_calls(r, max_calls)
    return r
