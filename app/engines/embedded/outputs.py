"""Turn the scheduler's token events into OpenAI Chat Completions objects (stream and non-stream).

Per generated token: incremental detokenization (text is held back while it ends in an
incomplete UTF-8 sequence or could be the start of a stop string), stop-string matching
(the text is cut before the stop string, the token that completed it stays in
``token_ids``, as in vLLM), tool-call parsing (``app.engines.embedded.toolparse``), and vLLM's
extension fields: ``prompt_token_ids`` / per-choice ``token_ids`` (``return_token_ids``,
https://github.com/vllm-project/vllm/pull/22587) and per-choice ``stop_reason``.
Turnstile adds ``policy_version`` (int) and ``engine_id`` at the top level of every
response and chunk; ``system_fingerprint`` is ``"<engine_id>:v<policy_version>"``.  A chat
logprob entry of a token drawn under top-k or top-p also carries ``support`` (int, the size of
the kept support) and ``rank`` (int, tokens that scored strictly higher), and its ``logprob``
is under the transformed distribution (``app.engines.embedded.sampling``).
"""
from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from app.engines.embedded.events import TokenEvent
from app.engines.embedded.toolparse import ContentEvent, ToolCallEvent, ToolCallParser


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte→unicode map used by byte-level BPE vocabularies (SmolLM2, Qwen)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenTexts:
    """Per-token display strings and raw bytes for logprob entries (cached per token id)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, lock: Any = None) -> None:
        self.tokenizer = tokenizer
        self.lock = lock or contextlib.nullcontext()
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            with self.lock:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                text = self.tokenizer.decode([token_id])
            decoder = _byte_decoder()
            if piece is not None and all(ch in decoder for ch in piece):
                raw = bytes(decoder[ch] for ch in piece)
            else:
                raw = text.encode("utf-8")
            hit = (raw.decode("utf-8", errors="replace"), list(raw))
            self._cache[token_id] = hit
        return hit


@dataclass
class ChatOptions:
    """Output options of one chat request (validated by the server)."""

    model: str
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    return_routed_experts: bool = False  # MoE: the experts each token ran through (vLLM's routed_experts)
    skip_special_tokens: bool = True
    parse_tools: bool = False
    include_usage: bool = False


@dataclass
class ChoiceDelta:
    """What one token event adds to the (single) choice."""

    content: str = ""
    tool_calls: list[ToolCallEvent] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    policy_version: int | None = None  # the weights that sampled this delta's token (None: no token)
    kv_version: int | None = None      # oldest version of the KV that token attended to


def version_runs(deltas: list[ChoiceDelta], attr: str = "policy_version") -> list[list[int]]:
    """Run-length encoding ``[[first token index, version], ...]`` of the per-token versions of
    ``deltas`` (``attr``: "policy_version" or "kv_version"), over their sampled tokens in order.

    One run for a completion sampled by one version; a completion that spans a ``keep`` weight
    update has one run per version.  Deltas without a version (none here) are skipped."""
    runs: list[list[int]] = []
    position = 0
    for d in deltas:
        version = getattr(d, attr)
        if d.token_ids and version is not None and (not runs or runs[-1][1] != version):
            runs.append([position, int(version)])
        position += len(d.token_ids)
    return runs


class ChoiceAssembler:
    """Consumes ``TokenEvent``s of one request; tells the caller when a stop string ends it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, texts: TokenTexts, options: ChatOptions) -> None:
        self.tokenizer = tokenizer
        self.texts = texts
        self.options = options
        self.token_ids: list[int] = []
        self._text = ""
        # Incremental detokenization with the tokenizers library's streaming decoder
        # (`tokenizers.decoders.DecodeStream`, as vLLM's fast detokenizer): it returns the text a
        # token adds, None while the bytes so far end inside a UTF-8 character, and keeps the
        # word-boundary spaces of SentencePiece-style (Metaspace) vocabularies, which decoding a
        # token on its own drops ("▁world" alone decodes to "world").  A tokenizer that cleans up
        # spaces after decoding (clean_up_tokenization_spaces), or has no fast backend, is
        # decoded whole per token instead.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = None if getattr(tokenizer, "clean_up_tokenization_spaces", False) else backend
        self._stream = DecodeStream(skip_special_tokens=options.skip_special_tokens) if self._backend else None
        self._emitted = 0
        self._parser = ToolCallParser() if options.parse_tools else None
        self.finished = False
        self.route_blocks = None  # MoE: the scheduler's live route list of this request

    def _logprob_entry(self, event: TokenEvent) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text, raw = self.texts.get(token_id)
            token = f"token_id:{token_id}" if self.options.return_tokens_as_token_ids else text
            return {"token": token, "logprob": logprob, "bytes": raw}
        item = entry(event.sample.token_id, event.sample.logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in event.sample.top[: self.options.top_logprobs]]
        if event.sample.support is not None:  # top-k / top-p truncated: the kept support's size
            item["support"], item["rank"] = event.sample.support, event.sample.rank
        return item

    def add(self, event: TokenEvent) -> ChoiceDelta:
        """Account for one token; the returned delta has ``finish_reason`` set when the choice ended."""
        delta = ChoiceDelta(token_ids=[event.sample.token_id], policy_version=event.policy_version,
                            kv_version=event.kv_version)
        self.token_ids.append(event.sample.token_id)
        self.route_blocks = event.routes
        if self.options.logprobs:
            delta.logprobs.append(self._logprob_entry(event))
        done = event.finish_reason is not None
        self._detokenize(event.sample.token_id, done)
        text_end, stop_hit = self._visible_end(done)
        piece = self._text[self._emitted:text_end]
        self._emitted = text_end
        if stop_hit is not None:
            delta.finish_reason, delta.stop_reason, done = "stop", stop_hit, True
        elif done:
            delta.finish_reason, delta.stop_reason = event.finish_reason, event.stop_token_id
        self._route_text(delta, piece, final=done)
        if done:
            self.finished = True
            if delta.finish_reason == "stop" and self._parser is not None and self._parser.calls:
                delta.finish_reason = "tool_calls"
        return delta

    def abort(self) -> ChoiceDelta:
        """End the choice with finish_reason "abort" (a weight update in mode ``abort``): the
        text held back (a partial UTF-8 character, a possible stop string) is shown as it is."""
        delta = ChoiceDelta(finish_reason="abort")
        if self.token_ids:
            with self.texts.lock:
                full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.options.skip_special_tokens)
            if full.startswith(self._text):
                self._text = full
        piece = self._text[self._emitted:]
        self._emitted = len(self._text)
        self._route_text(delta, piece, final=True)
        self.finished = True
        return delta

    def _detokenize(self, token_id: int, done: bool) -> None:
        """Extend `_text` by what `token_id` adds; an incomplete UTF-8 character is held back
        until it completes, or shown as U+FFFD when the choice ends on it."""
        skip = self.options.skip_special_tokens
        with self.texts.lock:  # HF fast tokenizers are not safe for concurrent use
            if self._stream is not None:
                piece = self._stream.step(self._backend, token_id)
                if piece is not None:
                    self._text += piece
                if done and piece is None:  # flush the held-back bytes, as a whole decode shows them
                    full = self.tokenizer.decode(self.token_ids, skip_special_tokens=skip)
                    if full.startswith(self._text):
                        self._text = full
                return
            full = self.tokenizer.decode(self.token_ids, skip_special_tokens=skip)
        if not full.endswith("\ufffd") or done:
            self._text = full

    def _visible_end(self, done: bool) -> tuple[int, str | None]:
        """End of the text that may be shown now, and the stop string that matched (if any)."""
        stops = self.options.stop
        if not stops:
            return len(self._text), None
        longest = max(len(s) for s in stops)
        search_from = max(0, self._emitted - longest)
        hits = [(self._text.find(s, search_from), s) for s in stops]
        hits = [(pos, s) for pos, s in hits if pos >= 0]
        if hits:
            pos, stop = min(hits)
            return pos, stop
        if done:
            return len(self._text), None
        hold = 0  # longest suffix that may still grow into a stop string
        for s in stops:
            for size in range(min(len(s) - 1, len(self._text)), 0, -1):
                if s.startswith(self._text[-size:]):
                    hold = max(hold, size)
                    break
        return max(self._emitted, len(self._text) - hold), None

    def _route_text(self, delta: ChoiceDelta, piece: str, final: bool) -> None:
        if self._parser is None:
            delta.content = piece
            return
        events = self._parser.feed(piece) + (self._parser.finish() if final else [])
        delta.content = "".join(e.text for e in events if isinstance(e, ContentEvent))
        delta.tool_calls = [e for e in events if isinstance(e, ToolCallEvent)]


def _envelope(kind: str, completion_id: str, created: int, options: ChatOptions, policy_version: int,
              engine_id: str) -> dict[str, Any]:
    return {"id": completion_id, "object": kind, "created": created, "model": options.model,
            "system_fingerprint": f"{engine_id}:v{policy_version}", "engine_id": engine_id,
            "policy_version": policy_version}


def version_fields(deltas: list[ChoiceDelta]) -> dict[str, Any]:
    """The per-token version fields of a whole (non-stream) answer: ``policy_versions`` (runs of
    the sampling version, ``version_runs``), and ``kv_versions`` where some token attended to KV
    of older weights than sampled it; the envelope's ``policy_version`` is the first token's."""
    runs = version_runs(deltas)
    out: dict[str, Any] = {"policy_versions": runs} if runs else {}
    if any(d.kv_version is not None and d.kv_version != d.policy_version for d in deltas):
        out["kv_versions"] = version_runs(deltas, "kv_version")
    if runs:
        out["policy_version"] = runs[0][1]
    return out


def new_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ChunkBuilder:
    """Builds the ``chat.completion.chunk`` objects of one streamed completion."""

    def __init__(self, options: ChatOptions, prompt_ids: list[int], policy_version: int, engine_id: str) -> None:
        self.options = options
        self.prompt_ids = prompt_ids
        self.policy_version = policy_version
        self.engine_id = engine_id
        self.completion_id = new_completion_id()
        self.created = int(time.time())

    def _chunk(self, choices: list[dict], policy_version: int | None = None) -> dict:
        out = _envelope("chat.completion.chunk", self.completion_id, self.created, self.options,
                        self.policy_version if policy_version is None else policy_version, self.engine_id)
        out["choices"] = choices
        if self.options.include_usage:
            out["usage"] = None
        return out

    def first(self) -> dict:
        """Role chunk; carries ``prompt_token_ids`` when ``return_token_ids`` was asked."""
        chunk = self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
        if self.options.return_token_ids:
            chunk["prompt_token_ids"] = self.prompt_ids
        return chunk

    def delta(self, d: ChoiceDelta) -> dict | None:
        """Chunk for one token's delta, or None when it would carry nothing the client asked for."""
        body: dict[str, Any] = {}
        if d.content:
            body["content"] = d.content
        if d.tool_calls:
            body["tool_calls"] = [call.as_delta() for call in d.tool_calls]
        if not body and d.finish_reason is None and not self.options.return_token_ids and not self.options.logprobs:
            return None
        choice: dict[str, Any] = {"index": 0, "delta": body,
                                  "logprobs": {"content": d.logprobs} if self.options.logprobs else None,
                                  "finish_reason": d.finish_reason}
        if d.finish_reason is not None:
            choice["stop_reason"] = d.stop_reason
        if self.options.return_token_ids:
            choice["token_ids"] = d.token_ids
        # Each chunk is stamped with the version that sampled its token: a stream that spans a
        # `keep` weight update changes version between two chunks (the gateway records the runs).
        chunk = self._chunk([choice], d.policy_version)
        if d.kv_version is not None and d.kv_version != d.policy_version:
            chunk["kv_version"] = d.kv_version
        return chunk

    def usage_chunk(self, completion_tokens: int) -> dict:
        chunk = self._chunk([])
        chunk["usage"] = usage(len(self.prompt_ids), completion_tokens)
        return chunk


def build_response(options: ChatOptions, prompt_ids: list[int], deltas: list[ChoiceDelta],
                   policy_version: int, engine_id: str) -> dict:
    """Non-streaming ``chat.completion`` object from all deltas of the single choice."""
    content = "".join(d.content for d in deltas)
    calls = [c for d in deltas for c in d.tool_calls]
    message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
    if calls:
        message["tool_calls"] = [c.as_openai() for c in calls]
    last = deltas[-1]
    token_ids = [t for d in deltas for t in d.token_ids]
    choice: dict[str, Any] = {
        "index": 0, "message": message,
        "logprobs": {"content": [e for d in deltas for e in d.logprobs]} if options.logprobs else None,
        "finish_reason": last.finish_reason, "stop_reason": last.stop_reason}
    if options.return_token_ids:
        choice["token_ids"] = token_ids
    out = _envelope("chat.completion", new_completion_id(), int(time.time()), options, policy_version, engine_id)
    out["choices"] = [choice]
    out["usage"] = usage(len(prompt_ids), len(token_ids))
    out.update(version_fields(deltas))
    if options.return_token_ids:
        out["prompt_token_ids"] = prompt_ids
    return out


# ---------------------------------------------------------------- legacy completions (token-id prompts)
def legacy_logprobs(deltas: list[ChoiceDelta], with_top: bool) -> dict:
    """OpenAI legacy completions logprobs ``{tokens, token_logprobs, top_logprobs, text_offset}``."""
    entries = [e for d in deltas for e in d.logprobs]
    offsets, position = [], 0
    for entry in entries:
        offsets.append(position)
        position += len(entry["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries] if with_top else None,
            "text_offset": offsets}


def completion_choice(options: ChatOptions, deltas: list[ChoiceDelta]) -> dict:
    """One ``text_completion`` choice (also used, with a single delta, for stream chunks)."""
    choice: dict[str, Any] = {"index": 0, "text": "".join(d.content for d in deltas),
                              "logprobs": legacy_logprobs(deltas, options.top_logprobs > 0) if options.logprobs else None,
                              "finish_reason": deltas[-1].finish_reason if deltas else None}
    if deltas and deltas[-1].finish_reason is not None:
        choice["stop_reason"] = deltas[-1].stop_reason
    if options.return_token_ids:
        choice["token_ids"] = [t for d in deltas for t in d.token_ids]
    return choice


def completion_object(options: ChatOptions, completion_id: str, created: int, policy_version: int,
                      engine_id: str, choices: list[dict]) -> dict:
    out = _envelope("text_completion", completion_id, created, options, policy_version, engine_id)
    out["choices"] = choices
    return out
