"""Gemini thought signatures through google-genai, the gateway and the scripted engine, with
splicing off: an answer that reasoned carries a `thoughtSignature` on its first part after the
thinking (https://ai.google.dev/gemini-api/docs/thought-signatures); a client that sends the turn
back without its thought parts, as Gemini CLI does, gets its reasoning restored from the
signature, so the next prompt extends the sampled ids (app/proxy/gemini.py `_sign`).
"""
from __future__ import annotations

import pytest
from google.genai import types
from support.gateway import completions, make_episode

from app import db
from app.conformance.scripted import directive
from app.tables import Episode, Run

REASONING = "The user wants the weather — ask the tool ✓."
REPLIES = {"call": {"reasoning": REASONING, "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]},
           "text": {"reasoning": REASONING, "text": "It is sunny in Paris, I think."}}


def unspliced_episode() -> tuple[int, str]:
    """A running episode whose run turned splicing off (`splice_history: false`)."""
    ep, token = make_episode()
    with db.session_scope() as s:
        s.get(Run, s.get(Episode, ep).run_id).config = {"splice_history": False}
    return ep, token


def cli_history(parts: list[types.Part]) -> list[types.Part]:
    """The model turn as Gemini CLI keeps it (geminiChat.processStreamResponse): thought parts
    dropped, consecutive text parts merged into the first, other fields of that first part kept."""
    kept: list[types.Part] = []
    for p in parts:
        if p.thought:
            continue
        if kept and kept[-1].text is not None and p.text is not None and not kept[-1].function_call:
            kept[-1] = kept[-1].model_copy(update={"text": kept[-1].text + p.text})
        else:
            kept.append(p)
    return kept


@pytest.mark.parametrize("kind", ["call", "text"])
@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_survives_a_history_without_thoughts(gw, sdk, stream, kind):
    ep, token = unspliced_episode()
    client = sdk.gemini(token)
    decl = types.FunctionDeclaration(name="get_weather", parameters=types.Schema(
        type="OBJECT", properties={"city": types.Schema(type="STRING")}))
    config = types.GenerateContentConfig(tools=[types.Tool(function_declarations=[decl])],
                                         thinking_config=types.ThinkingConfig(include_thoughts=True))

    def parts_of(contents) -> list[types.Part]:
        if not stream:
            r = client.models.generate_content(model="gemini-2.5-pro", contents=contents, config=config)
            return list(r.candidates[0].content.parts)
        return [p for r in client.models.generate_content_stream(model="gemini-2.5-pro", contents=contents,
                                                                 config=config)
                for cand in r.candidates or [] if cand.content for p in cand.content.parts or []]

    user = types.Content(role="user", parts=[types.Part(text="weather? " + directive(REPLIES[kind]))])
    parts = parts_of([user])
    assert "".join(p.text or "" for p in parts if p.thought) == REASONING
    visible = [p for p in parts if not p.thought]
    signed = [p for p in parts if p.thought_signature]
    assert signed == visible[:1]  # one signature, on the first part after the thinking
    if kind == "call":
        assert visible[0].function_call.name == "get_weather"
    model_turn = types.Content(role="model", parts=cli_history(parts))
    assert not any(p.thought for p in model_turn.parts) and model_turn.parts[0].thought_signature
    follow = [types.Part(text="thanks " + directive({"text": "done"}))]
    if kind == "call":
        call = visible[0].function_call
        follow.insert(0, types.Part(function_response=types.FunctionResponse(
            id=call.id, name=call.name, response={"output": "sunny"})))
    parts2 = parts_of([user, model_turn, types.Content(role="user", parts=follow)])
    assert "".join(p.text or "" for p in parts2 if not p.thought) == "done"
    first, second = completions(ep)
    assert second.raw_request["splice"] == {"miss": "disabled"}  # rendered from text
    assert second.normalized_request["messages"][1]["reasoning"] == REASONING  # restored from the signature
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.sampled_ids)] == first.prompt_ids + first.sampled_ids


def test_a_foreign_signature_restores_nothing(gw, sdk):
    """Gemini CLI puts a synthetic signature on calls it lacks one for: accepted, no reasoning."""
    ep, token = unspliced_episode()
    client = sdk.gemini(token)
    contents = [types.Content(role="user", parts=[types.Part(text="go")]),
                types.Content(role="model", parts=[types.Part(text="ok",
                                                              thought_signature=b"skip_thought_signature_validator")]),
                types.Content(role="user", parts=[types.Part(text="again " + directive({"text": "fine"}))])]
    assert client.models.generate_content(model="gemini-x", contents=contents).text == "fine"
    [rec] = completions(ep)
    assert "reasoning" not in rec.normalized_request["messages"][1]
