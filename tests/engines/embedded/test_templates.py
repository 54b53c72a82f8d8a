"""Tool-call template ⇄ parser round trip through the engine's real output path (no model needed).

The assistant turn is rendered by the tool template, tokenized, and its token ids are fed one
by one through ``ChoiceAssembler`` (detokenizer + stop handling + Hermes parser), exactly as
the scheduler's token events are in the server.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.engines.embedded.events import TokenEvent
from app.engines.modeling import load_tokenizer
from app.engines.embedded.outputs import ChatOptions, ChoiceAssembler, ChunkBuilder, TokenTexts, build_response
from app.engines.embedded.sampling import TokenSample
from app.engines.embedded.templates import TOOL_CHAT_TEMPLATE, TemplateError, render_prompt
from app.engines.embedded.toolparse import ToolCallParser, parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "edit_file", "description": "Edit a file",
                                           "parameters": {"type": "object", "properties": {
                                               "path": {"type": "string"}, "new_text": {"type": "string"}}}}}]
CALLS = [
    {"id": "call_1", "type": "function", "function": {"name": "edit_file",
                                                      "arguments": json.dumps({"path": "a.py", "new_text": "x = 1\n"})}},
    {"id": "call_2", "type": "function", "function": {"name": "run", "arguments": json.dumps({"cmd": "pytest -q ü"})}},
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def assistant_completion_ids(tokenizer, content, calls) -> list[int]:
    """Token ids the model would sample for this assistant turn (template rendering minus the prompt)."""
    history = [{"role": "user", "content": "fix it"}]
    prompt = render_prompt(tokenizer, history, TOOLS)
    full = render_prompt(tokenizer, history + [{"role": "assistant", "content": content, "tool_calls": calls}],
                         TOOLS, add_generation_prompt=False)
    assert full[: len(prompt)] == prompt, "the assistant turn must extend the generation prompt"
    completion = full[len(prompt):]
    end = completion.index(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return completion[: end + 1]  # up to and including <|im_end|>, where the engine stops


def run_assembler(tokenizer, ids, stream: bool):
    options = ChatOptions(model="m", parse_tools=True, return_token_ids=True)
    assembler = ChoiceAssembler(tokenizer, TokenTexts(tokenizer), options)
    deltas = []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        deltas.append(assembler.add(TokenEvent(TokenSample(token, -0.5, ()), "stop" if last else None,
                                               token if last else None)))
    if stream:
        builder = ChunkBuilder(options, [1, 2], 0, "e")
        chunks = [c for c in (builder.delta(d) for d in deltas) if c is not None]
        content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        calls = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls", [])]
        for call in calls:  # first (and only) fragment of each call carries the full shape
            assert set(call) == {"index", "id", "type", "function"} and call["type"] == "function"
        return content or None, [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls], chunks[-1]["choices"][0]
    response = build_response(options, [1, 2], deltas, 0, "e")
    choice = response["choices"][0]
    assert choice["token_ids"] == ids
    return (choice["message"]["content"],
            [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in choice["message"].get("tool_calls", [])],
            choice)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("content", [None, "I will edit the file."])
def test_tool_call_round_trip(tokenizer, stream, content):
    ids = assistant_completion_ids(tokenizer, content, CALLS)
    got_content, got_calls, last_choice = run_assembler(tokenizer, ids, stream)
    assert got_content == content
    assert [c["name"] for c in got_calls] == ["edit_file", "run"]
    assert [json.loads(c["arguments"]) for c in got_calls] == [json.loads(c["function"]["arguments"]) for c in CALLS]
    assert last_choice["finish_reason"] == "tool_calls"


def test_plain_text_passes_through_unchanged(tokenizer):
    text = "Hello <tool but not a call> and trailing space \n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    for stream in (False, True):
        content, calls, choice = run_assembler(tokenizer, ids, stream)
        assert content == text and calls == [] and choice["finish_reason"] == "stop"


def test_unterminated_or_invalid_calls_stay_content():
    assert parse_tool_calls('ok <tool_call>{"name": "f", "argu') == ('ok <tool_call>{"name": "f", "argu', [])
    assert parse_tool_calls("x <tool_call>{not json}</tool_call>") == ("x <tool_call>{not json}</tool_call>", [])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=40))
def test_streaming_parser_equals_whole_text_parse_for_any_split(cuts):
    text = 'Plan:\n<tool_call>\n{"name": "f", "arguments": {"a": "<b>"}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    parser, events, pos = ToolCallParser(), [], 0
    for cut in cuts:
        events += parser.feed(text[pos:pos + cut])
        pos += cut
    events += parser.feed(text[pos:]) + parser.finish()
    content = "".join(getattr(e, "text", "") for e in events)
    whole_content, whole_calls = parse_tool_calls(text)
    assert content == whole_content == "Plan:"
    assert [(c.name, c.arguments) for c in parser.calls] == [(c.name, c.arguments) for c in whole_calls]


def test_template_keeps_plain_chat_on_models_own_template(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    assert render_prompt(tokenizer, messages) == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=False)
    rendered = tokenizer.decode(render_prompt(tokenizer, messages, TOOLS))
    assert "<tools>" in rendered and '"name": "edit_file"' in rendered
    assert "tools" not in tokenizer.chat_template and "tool_call" in TOOL_CHAT_TEMPLATE


def test_template_errors_are_clear(tokenizer):
    with pytest.raises(TemplateError, match="role"):
        render_prompt(tokenizer, [{"role": "robot", "content": "x"}])
    with pytest.raises(TemplateError, match="image_url"):
        render_prompt(tokenizer, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(TemplateError, match="function.name"):
        render_prompt(tokenizer, [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}])


@pytest.mark.parametrize("stop", [[], ["🎉 d"]])
def test_incremental_detokenization_of_multibyte_text(tokenizer, stop):
    """Token-by-token text equals the full decode (split emoji/CJK bytes are held back), and a
    stop string spanning tokens cuts the text exactly before it."""
    text = "Hello , world . ünïcödé 日本語 🎉🎉 done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assembler = ChoiceAssembler(tokenizer, TokenTexts(tokenizer), ChatOptions(model="m", stop=stop))
    pieces = []
    for i, token in enumerate(ids):
        delta = assembler.add(TokenEvent(TokenSample(token, 0.0, ()), "length" if i == len(ids) - 1 else None))
        assert "\ufffd" not in delta.content
        pieces.append(delta.content)
        if delta.finish_reason:
            break
    expected = text[: text.find(stop[0])] if stop else text
    assert "".join(pieces) == expected
    assert delta.finish_reason == ("stop" if stop else "length")


def _metaspace_tokenizer():
    """A small SentencePiece-style tokenizer (Metaspace pre-tokenizer and decoder, BPE with byte
    fallback, like Llama 2 and Mistral), trained here in memory: words carry their leading space as
    "▁", which a lone token's decode drops, and characters outside the vocabulary become byte
    tokens <0xNN> (ordinary tokens, not special ones)."""
    import json as _json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    trained.train_from_iterator(["hello world foobar world", "the quick brown fox jumps over the lazy dog"] * 20, trainer)
    spec = _json.loads(trained.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


@pytest.mark.parametrize("kind", ["byte-level BPE", "Metaspace"])
def test_streamed_text_keeps_word_spaces_and_multibyte_characters(tokenizer, kind):
    """Streaming keeps the spaces of both vocabulary kinds and holds back a character split over
    several tokens: the streamed text equals the whole decode, for a stop string too."""
    tok = tokenizer if kind == "byte-level BPE" else _metaspace_tokenizer()
    text = "hello world foobar world ü 🙂 done"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    for stop in ([], ["r world"]):
        assembler = ChoiceAssembler(tok, TokenTexts(tok), ChatOptions(model="m", stop=stop))
        pieces = []
        for i, token in enumerate(ids):
            delta = assembler.add(TokenEvent(TokenSample(token, 0.0, ()), "length" if i == len(ids) - 1 else None))
            assert "\ufffd" not in delta.content
            pieces.append(delta.content)
            if delta.finish_reason:
                break
        assert "".join(pieces) == (text[: text.find(stop[0])] if stop else text)


def test_continue_final_message_ends_the_prompt_inside_the_prefill(tokenizer):
    """An assistant prefill ("1,") is continued: the prompt ends with it, with no end-of-turn
    and no new assistant header after it (vLLM's `continue_final_message`)."""
    messages = [{"role": "user", "content": "count to 3"}, {"role": "assistant", "content": "1,"}]
    text = tokenizer.decode(render_prompt(tokenizer, messages, continue_final_message=True))
    assert text.endswith("<|im_start|>assistant\n1,")
    closed = tokenizer.decode(render_prompt(tokenizer, messages))
    assert closed.endswith("<|im_start|>assistant\n")
    assert closed.count("<|im_start|>assistant") == 2
