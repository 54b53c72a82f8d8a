"""A fast, deterministic scripted engine speaking the engine contract.

The contract is OpenAI Chat Completions with vLLM's extensions:
`return_token_ids` (top-level `prompt_token_ids`, per-choice `token_ids`),
`logprobs`, per-choice `stop_reason`, `/tokenize`, `/v1/models` with
`max_model_len`, the Turnstile extension `policy_version`, and `prompt_token_ids` in the
request (a prompt given as ids is used verbatim instead of the rendering).

Everything is derivable so tests can check ids end to end:
  prompt text  = `render_prompt(body)` (a tiny fixed chat template)
  token ids    = `encode(text)`: UTF-8 bytes + OFFSET, one id per byte
  sampled text = `sampled_text(reply)`: `<think>R</think>` + text + `<tool_call>{...}</tool_call>`*
  logprob      = `logprob(position, token_id)`

Replies come from (first match wins):
  1. an inline directive `<<script:BASE64URL(JSON reply)>>` in the conversation (latest message first);
  2. a script file (`--script` / TURNSTILE_SCRIPT): {"default": [reply...], "episodes": {"<id>": [reply...]}},
     consumed in order per episode (header `x-turnstile-episode`), the last reply repeating;
  3. a minimal JSON value when JSON output is requested, else the text "ok".

A reply is a JSON object: text, reasoning, reasoning_field ("reasoning" | "reasoning_content"),
tool_calls [{name, arguments, id?}], refusal, error {status, message}, prefill_delay (after the response
headers, like vLLM), header_delay (before them), slow_first (delay only the first identical request), token_delay (s),
abort_after (chunks, then close without [DONE]), error_after (chunks, then an error chunk),
garbage_after (chunks, then one chunk whose `choices` is not a list; non-stream forms in `non_stream_fault`),
quirk ("no_type" | "repeat_id" | "same_index" | "args_at_end" | "args_in_header"), split_bytes (send SSE bytes in 1-byte
writes that split UTF-8 characters), policy_version, cached_tokens (reported as cached prompt tokens).
Tool calls may carry their own `id` (an engine that numbers calls per answer, `call_0`, reuses ids);
quirk "args_object" sends a call's arguments as a JSON object instead of a string.
Delays watch the connection: a client that closes it aborts the request (like vLLM), and the abort
is listed at GET /_scripted/aborted.  `continue_final_message` continues the last (assistant)
message instead of opening a new one.

Run: `python -m app.conformance.scripted --port 8200 [--script FILE] [--max-model-len 8192]`.

Modules: `replies` (ids, logprobs, the prompt rendering, a reply planned into token steps,
quirks, the script state), `server` (the HTTP server and its small routes), `chat` (the chat
completions route: stream and non-stream, faults and delays), `check` (the conformance checks'
engine, answering by the conversation's state).  A test double: nothing in `app` below the
conformance layer imports it.
"""
from __future__ import annotations

from app.conformance.scripted.replies import (MODEL, OFFSET, Scripted, apply_quirk, directive, encode, logprob, plan,
                                              render_prompt)
from app.conformance.scripted.server import ScriptedServer, serve

__all__ = ["MODEL", "OFFSET", "Scripted", "ScriptedServer", "apply_quirk", "directive", "encode", "logprob", "plan",
           "render_prompt", "serve"]
