"""Prompt logprobs on the embedded engine: `POST /v1/completions` with vLLM's `prompt_logprobs`.

vLLM's sampling parameter `prompt_logprobs` (https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html)
returns, per prompt token, the logprob of that token and of the `prompt_logprobs` most likely
ones given the tokens before it: `choices[0].prompt_logprobs` is a list of T entries, None for
the first token, else `{str(id): {"logprob", "rank", "decoded_token"}}`.  A distillation teacher
served by this engine scores a student's chain this way (`app.training.teacher_scorers.RemoteScorer`).

Here the request is answered by one prefill pass over the prompt outside the batch loop (no
KV cache kept, no token generated: `max_tokens` is not used and `text` is empty); the LM head
runs `SCORE_CHUNK` positions at a time so no [T, vocab] tensor exists.  Weights cannot change
during the pass (`BatchScheduler.weights_pinned`).  Values are fp32 log-softmax, 1-based ranks
(an engine serving bfloat16 upcasts its bf16 logits to fp32 before the log-softmax).
A `model` naming a loaded LoRA adapter scores under that adapter (`adapters.rows`, the hooks
generation uses), so a tenant's prompt logprobs are its own policy's, not the base model's.
"""
from __future__ import annotations

import time

import torch
from flask import Response, jsonify

from app.engines.embedded import adapters
from app.engines.embedded.adapters import Adapter
from app.engines.embedded.engine import Engine
from app.engines.embedded.generate import completion_prompt
from app.engines.embedded.outputs import new_completion_id
from app.engines.embedded.validation import EngineError, get_field, json_body

SCORE_CHUNK = 256
MAX_TOP = 20


def wants_prompt_logprobs(body: dict) -> bool:
    """Whether a `/v1/completions` body asks for prompt logprobs (a value other than null)."""
    return isinstance(body, dict) and body.get("prompt_logprobs") is not None


def prompt_logprobs(engine: Engine, ids: list[int], top: int, adapter: Adapter | None = None) -> list[dict | None]:
    """vLLM-shaped prompt logprobs of `ids` (int [T]) with `top` (0..20) alternatives each, under
    `adapter` (None: the served weights alone)."""
    model = engine.model
    device = engine.scheduler.device
    with torch.no_grad(), engine.scheduler.weights_pinned(), adapters.rows([adapter], device):
        tokens = torch.tensor([ids], dtype=torch.long, device=engine.scheduler.device)
        hidden = model.model(input_ids=tokens, use_cache=False).last_hidden_state[0]
        out: list[dict | None] = [None]
        for start in range(0, len(ids) - 1, SCORE_CHUNK):
            end = min(start + SCORE_CHUNK, len(ids) - 1)
            logp = torch.log_softmax(model.lm_head(hidden[start:end]).float(), dim=-1)
            targets = tokens[0, start + 1 : end + 1]
            chosen = logp.gather(1, targets[:, None])[:, 0]
            ranks = (logp > chosen[:, None]).sum(dim=1) + 1
            best = logp.topk(top, dim=-1) if top else None
            for row in range(end - start):
                target = int(targets[row])
                entry = {str(target): {"logprob": float(chosen[row]), "rank": int(ranks[row])}}
                if best is not None:
                    for rank, (value, index) in enumerate(zip(best.values[row].tolist(), best.indices[row].tolist()), 1):
                        entry.setdefault(str(index), {"logprob": float(value), "rank": rank})
                out.append(entry)
    with engine.tokenizer_lock:
        for entry in out[1:]:
            for key, item in entry.items():
                item["decoded_token"] = engine.tokenizer.decode([int(key)])
    return out


def completions_with_prompt_logprobs(engine: Engine) -> Response:
    """Answer a `/v1/completions` request that asks for `prompt_logprobs` (see the module docstring).

    Raises `EngineError` (400) for a bad `prompt_logprobs`, `n`, `stream` or prompt.
    """
    body = json_body()
    top = get_field(body, "prompt_logprobs", int)
    if top is None or not 0 <= top <= MAX_TOP:
        raise EngineError(f"'prompt_logprobs' must be between 0 and {MAX_TOP}", param="prompt_logprobs")
    if get_field(body, "stream", bool, False):
        raise EngineError("'prompt_logprobs' is answered without streaming", param="stream")
    if get_field(body, "n", int, 1) != 1:
        raise EngineError("only n=1 is supported", param="n")
    ids = completion_prompt(engine, body)
    if len(ids) > engine.max_model_len:
        raise EngineError(f"This model's maximum context length is {engine.max_model_len} tokens. However, you "
                          f"requested {len(ids)} tokens ({len(ids)} in the prompt, 0 in the completion).", param="prompt")
    adapter = adapters.request_adapter(engine, body)
    started = time.perf_counter()
    entries = prompt_logprobs(engine, ids, top, adapter)
    choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
              "prompt_logprobs": entries, "prompt_token_ids": list(ids)}
    return jsonify({"id": new_completion_id().replace("chatcmpl", "cmpl"), "object": "text_completion",
                    "created": int(time.time()), "model": get_field(body, "model", str, engine.served_model_name)
                    or engine.served_model_name, "choices": [choice],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)},
                    "policy_version": engine.scheduler.policy_version, "engine_id": engine.engine_id,
                    "score_s": round(time.perf_counter() - started, 4)})
