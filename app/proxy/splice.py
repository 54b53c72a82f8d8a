"""Token-in splicing: render a request's history from the ids the policy sampled.

Harnesses send the whole conversation back on every call, and several of them
re-serialize it first (Qwen Code, OpenCode and Pi parse the arguments of earlier tool
calls and send them back as compact JSON).  Rendered from that text, the prompt no longer
holds the ids the engine sampled, so prefix merging cannot extend the session's chain and
the trainer re-processes the whole prefix for every call.  Here the gateway recognises
the newest assistant turn of the history as one of the same session's recorded
completions and builds the prompt as token ids (as slime, AReaL and rLLM keep the sampled
ids of earlier turns instead of re-rendering them); when the harness changed newer turns,
the newest unchanged recorded turn is the splice point and the changed ones are rendered
from their text in the tail:

    prompt = C.prompt_ids + C.sampled_ids + glue + tail

`C.prompt_ids` are exactly what the engine saw for that completion (themselves spliced
the same way), `C.sampled_ids` exactly what it sampled, `glue` the template's end of the
assistant turn minus the stop token the model already sampled, and `tail` the template's
rendering of the messages after that turn plus the generation prompt.  The engine gets
the ids in the chat request's `prompt_token_ids` field (the embedded and scripted engines
read it) and in `kv_transfer_params.prompt_token_ids` (vLLM 0.32's pre-tokenized chat
prompt, ignored by vLLM when a message holds images), and still parses tool
calls and reasoning from its own output.

Recognition is by content, in the API's own terms: the recorded answer is read back by
the same history reader as the turn the harness sent (`recorded_turn`), then compared
(`turn_key`): text up to surrounding whitespace (what templates strip), tool calls by name,
engine call id (after the gateway's own id mapping) and JSON-equal arguments (key order,
spacing, `1.0` vs `1`, unicode escapes do not matter); reasoning the harness sent back must
equal what was sampled, reasoning it dropped stays in the prompt as sampled.  The messages
before the turn must equal that completion's request in the same terms, with the same
tools and template options.  Anything else (an edited, truncated or dropped turn, a
summary in place of history, another session's answer) is rendered from text as before and
the miss is recorded; prefix merging then cuts the chain and counts the reason.

Cost: one SQL read of the episode's answers, one of the recognised completion, and two
`/tokenize` calls rendering the conversation (about 50 ms for a 75k-token prompt on the
scripted engine, loaded 2-core box); the closing probe is cached per engine.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from sqlalchemy import select

from app.db import session_scope
from app.tables import Completion
from app.proxy.apis import REGISTRY
from app.proxy import common as c
from app.proxy.canonical import engine_call_id
from app.proxy.errors import GatewayError

log = logging.getLogger("turnstile.gateway")

# Why the newest assistant turn was rendered from text instead of spliced (raw_request["splice"]["miss"]).
MISS_REASONS = {
    "no_assistant_turn": "the history holds no assistant turn",
    "prefill": "the request ends in an assistant prefill",
    "turn_not_recorded": "the newest assistant turn is none of this session's recorded answers "
                         "(edited, truncated, summarised, or from elsewhere)",
    "context_changed": "the turn is recorded, but the messages, tools or template options before it changed",
    "template_rerenders_history": "the template renders the turn's prefix differently once later messages follow",
    "engine_error": "the engine's tokenizer could not render the tail",
    "disabled": "the run turned splicing off (`splice_history: false`)",
    "internal_error": "the splice failed (logged); the request was rendered from text",
}


# --- canonical forms ----------------------------------------------------------------------


def canonical_json(value: Any) -> Any:
    """A hashable form of a JSON value in which equal JSON values compare equal.

    Objects ignore key order; numbers compare by value (`1.0` == `1`, but `true` != `1`);
    strings compare after JSON unescaping (done by the parser).  Shapes: tuples tagged by type.
    """
    if isinstance(value, dict):
        return ("o", tuple(sorted((str(k), canonical_json(v)) for k, v in value.items())))
    if isinstance(value, list):
        return ("a", tuple(canonical_json(v) for v in value))
    if isinstance(value, bool) or value is None:
        return ("c", value)
    if isinstance(value, (int, float)):
        try:
            return ("n", Decimal(repr(value)) if isinstance(value, float) else Decimal(value))
        except InvalidOperation:
            return ("n?", repr(value))
    return ("s", str(value))


def canonical_arguments(arguments: Any) -> Any:
    """Tool-call arguments (a JSON string or a value) in `canonical_json` form; text that is
    not JSON compares as itself."""
    if isinstance(arguments, str):
        try:
            return canonical_json(json.loads(arguments))
        except ValueError:
            return ("raw", arguments)
    return canonical_json(arguments if arguments is not None else {})


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return c.text_of([p for p in content if isinstance(p, dict)])


def turn_key(msg: dict) -> tuple:
    """What must match for an assistant message to be a recorded answer: stripped text and the
    tool calls (engine id, name, canonical arguments), in order."""
    calls = tuple((engine_call_id(tc.get("id") or ""), (tc.get("function") or {}).get("name"),
                   canonical_arguments((tc.get("function") or {}).get("arguments")))
                  for tc in msg.get("tool_calls") or [])
    return _text(msg.get("content")).strip(), calls


def _reasoning_compatible(sent: dict, recorded: dict) -> bool:
    """Reasoning the harness sent back must be what was sampled; reasoning it dropped is fine."""
    mine = (sent.get("reasoning") or "").strip()
    return not mine or mine == (recorded.get("reasoning") or "").strip()


def message_key(msg: dict) -> tuple:
    """A message of the history in comparable form (assistant turns by `turn_key`)."""
    role = msg.get("role")
    if role == "assistant":
        return role, turn_key(msg), (msg.get("reasoning") or "").strip()
    content = msg.get("content")
    body = content if isinstance(content, str) else canonical_json(content)
    return role, body, engine_call_id(msg.get("tool_call_id")) if msg.get("tool_call_id") else None, msg.get("name")


def _same_context(now: list[dict], then: list[dict]) -> bool:
    """Whether two histories are the same conversation in `message_key` terms; reasoning of an
    assistant turn is compared only when both sides hold it (a harness may drop it)."""
    if len(now) != len(then):
        return False
    for a, b in zip(now, then):
        ka, kb = message_key(a), message_key(b)
        if a.get("role") == "assistant" and b.get("role") == "assistant":
            if ka[1] != kb[1] or (ka[2] and kb[2] and ka[2] != kb[2]):
                return False
        elif ka != kb:
            return False
    return True


# --- the recorded answer, read back in its API's own terms ---------------------------------


def recorded_turn(api: str, response: dict | None) -> dict | None:
    """The assistant message the client received in `response` (a recorded non-stream body of
    `api`), normalized by that API's own history reader exactly as the harness's copy of it
    will be; None when the body holds no answer."""
    module = REGISTRY.get(api)
    return module.answer_of(response) if module is not None else None


# --- finding the completion ------------------------------------------------------------------


@dataclass
class Recorded:
    """The fields of one recorded completion that a splice needs."""

    id: int
    prompt_ids: list[int]
    sampled_ids: list[int]
    finish_reason: str | None
    request: dict  # its normalized (engine) request: messages, tools, chat_template_kwargs, model


@dataclass
class Splice:
    """The outcome for one request: `prompt_ids` to send (None: render from text) and the
    report recorded with the completion (`raw_request["splice"]`)."""

    prompt_ids: list[int] | None = None
    report: dict = field(default_factory=dict)


def _template_options(body: dict) -> tuple:
    return (canonical_json(body.get("tools") or []), canonical_json(body.get("chat_template_kwargs") or {}))


def recorded_answers(episode_id: int, attempt: int = 1) -> list[tuple[int, dict]]:
    """(completion id, assistant message) of every finished (non-partial) completion of
    `episode_id`'s rollout `attempt` (one session token: the session), newest first, the message
    read back by `recorded_turn`."""
    with session_scope() as s:
        rows = s.execute(select(Completion.id, Completion.api, Completion.response)
                         .where(Completion.episode_id == episode_id, Completion.attempt == attempt,
                                Completion.partial.is_(False))
                         .order_by(Completion.seq.desc())).all()
    answers = []
    for row in rows:
        got = recorded_turn(row.api, row.response)
        if got is not None:
            answers.append((row.id, got))
    return answers


def find_completion(answers: list[tuple[int, dict]], messages: list[dict], index: int, request: dict,
                    engine_model: str | None) -> tuple[Recorded | None, str | None]:
    """The newest of `answers` (`recorded_answers`: one episode's) that is `messages[index]` and
    whose request holds `messages[:index]`, the same tools and template options (and engine model).

    Returns (completion, None) or (None, miss reason: `turn_not_recorded` | `context_changed`).
    """
    turn = messages[index]
    want = turn_key(turn)
    candidates = [cid for cid, got in answers if turn_key(got) == want and _reasoning_compatible(turn, got)]
    if not candidates:
        return None, "turn_not_recorded"
    options = _template_options(request)
    with session_scope() as s:
        for cid in candidates:
            row = s.execute(select(Completion.prompt_ids, Completion.sampled_ids, Completion.finish_reason,
                                   Completion.normalized_request).where(Completion.id == cid)).one()
            then = row.normalized_request or {}
            if not row.prompt_ids or not row.sampled_ids:
                continue
            if then.get("continue_final_message") or _template_options(then) != options:
                continue
            # A LoRA run's adapter versions (`<label>@<hash>`) share the served model's tokenizer.
            if engine_model is not None and then.get("model") not in (None, engine_model) \
                    and "@" not in str(then.get("model")):
                continue
            if _same_context(messages[:index], list(then.get("messages") or [])):
                return Recorded(cid, list(row.prompt_ids), list(row.sampled_ids), row.finish_reason,
                                then), None
    return None, "context_changed"


# --- the template's pieces, through the engine's /tokenize ----------------------------------

_closings: dict[tuple, list[int]] = {}
_PROBES = ("A1", "B22")


def _tokenize(up, engine, body: dict, messages: list[dict], generation_prompt: bool) -> list[int]:
    tok = {"model": engine.model, "messages": messages, "add_generation_prompt": generation_prompt}
    for k in ("tools", "chat_template_kwargs"):
        if body.get(k):
            tok[k] = body[k]
    return list(up.tokenize(engine, tok).get("tokens") or [])


def _common_suffix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def closing_ids(up, engine, body: dict) -> list[int]:
    """Token ids the template puts after an assistant turn's content (e.g. ChatML's
    `<|im_end|>` + newline): the common suffix of two one-turn conversations whose answers
    differ in their last character.  Cached per engine, model and template options."""
    key = (engine.url, engine.model, json.dumps(body.get("chat_template_kwargs") or {}, sort_keys=True),
           bool(body.get("tools")))
    if key not in _closings:
        a, b = (_tokenize(up, engine, body, [{"role": "user", "content": "u"}, {"role": "assistant", "content": p}],
                          False) for p in _PROBES)
        _closings[key] = a[len(a) - _common_suffix(a, b):]
    return _closings[key]


def glue_ids(closing: list[int], sampled: list[int], finish_reason: str | None) -> list[int]:
    """The part of the template's turn closing the model did not sample: all of it, less its
    first token when the answer ended by sampling that token (the end-of-turn/stop token)."""
    if closing and sampled and finish_reason != "length" and sampled[-1] == closing[0]:
        return closing[1:]
    return list(closing)


def _with_reasoning_probe(msg: dict) -> dict:
    # Some templates render an assistant turn differently when it is the last message (Qwen3
    # adds an empty think block) unless it carries reasoning; the turn's own rendering is
    # replaced by its sampled ids anyway, so both renderings get the same placeholder (under
    # both names templates read: Qwen3's `reasoning_content`, the gateway's `reasoning`).
    text = msg.get("reasoning") or "…"
    return dict(msg, reasoning=text, reasoning_content=text)


def splice(up, engine, episode_id: int, api: str, body: dict, attempt: int = 1) -> Splice:
    """Plan and build the prompt ids of one request (`body`: the engine chat request, messages
    finalized).  Never raises for a miss; GatewayError from the engine's /tokenize becomes the
    miss `engine_error` (the request is then rendered from text by the engine).  Only the
    completions of this session (`episode_id`'s rollout `attempt`) are candidates.

    The newest assistant turn that is a recorded answer (with its context unchanged) is the
    splice point; assistant turns after it, which the harness changed, are rendered from their
    text in the tail (`rendered_turns` in the report, with the newest turn's miss reason).
    """
    messages = list(body.get("messages") or [])
    if body.get("continue_final_message"):
        return Splice(report={"miss": "prefill"})
    turns = [i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "assistant"]
    if not turns:
        return Splice(report={"miss": "no_assistant_turn"})
    answers = recorded_answers(episode_id, attempt)
    found, newest_miss = None, None
    for index in turns:
        found, miss = find_completion(answers, messages, index, body, engine.model)
        if found is not None:
            break
        newest_miss = newest_miss or miss
    if found is None:
        return Splice(report={"miss": newest_miss, "turn": turns[0]})
    try:
        probe = messages[:index] + [_with_reasoning_probe(messages[index])]
        head = _tokenize(up, engine, body, probe, False)
        full = _tokenize(up, engine, body, probe + messages[index + 1:], body.get("add_generation_prompt", True))
        closing = closing_ids(up, engine, body)
    except GatewayError as exc:
        log.warning("splice: tokenize failed, rendering from text: %s", exc.message)
        return Splice(report={"miss": "engine_error", "turn": index, "recognised": found.id})
    if full[:len(head)] != head:
        return Splice(report={"miss": "template_rerenders_history", "turn": index, "recognised": found.id})
    glue = glue_ids(closing, found.sampled_ids, found.finish_reason)
    tail = full[len(head):]
    ids = found.prompt_ids + found.sampled_ids + glue + tail
    # `prompt_tokens`: what the engine was sent; an engine that ignored the ids (and rendered the
    # messages itself) shows as a recorded prompt of another length.
    report = {"completion": found.id, "turn": index, "spliced_tokens": len(found.prompt_ids) + len(found.sampled_ids),
              "glue_tokens": len(glue), "tail_tokens": len(tail), "prompt_tokens": len(ids)}
    rendered = turns.index(index)
    if rendered:
        report.update(rendered_turns=rendered, miss=newest_miss)
    return Splice(ids, report)
