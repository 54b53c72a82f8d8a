"""A Tinker `sample` request answered by the inference engines (the gateway's engine client).

The SDK's `SamplingClient.sample(prompt, num_samples, sampling_params, include_prompt_logprobs,
topk_prompt_logprobs, ...)` arrives as the JSON of its `tinker.types.SampleRequest`
(`model_dump(mode="json")`, stored on the future):

    {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [int]}]}, "num_samples": int,
     "sampling_params": {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop"},
     "prompt_logprobs": bool | None, "topk_prompt_logprobs": int, "topk_sample_logprobs": int, ...}

It is answered on the tokens-in path of the engines (`POST /v1/completions` with the prompt as ids,
no chat template, so the ids sampled from are exactly the SDK's), under the sampler's LoRA adapter
when the sampling session names one (`model` = the adapter's served name), else the base model:

* each of the `num_samples` sequences is one completion request; they are sent at once, so the
  engine batches them and its prefix cache serves the shared prompt after the first prefill;
* `seed` s gives sample i the seed s + i: reproducible, and not `num_samples` copies of one draw;
* `stop`: None keeps the model's stop tokens; `[]` disables every stop, EOS included
  (`ignore_eos`); strings are stop strings, ints stop token ids.  The sampled ids keep the stop
  token, as Tinker's renderers expect (they parse a message up to it);
* logprobs of the sampled tokens are always returned: fp32, under the distribution each token was
  drawn from (temperature, top-k, top-p applied: `app.engines.embedded.sampling`), which at
  temperature 1 without truncation is the policy's own logprob; `prompt_logprobs` comes from one prefill-only scoring pass
  over the prompt under the same adapter (`POST /v1/completions` with vLLM's `prompt_logprobs`),
  None at position 0, and `prompt_logprobs_last_n` leaves earlier positions None.

The result is what `app.tinker.wire.encode_sample_response` sends as the SDK's protobuf:

    {"sequences": [{"stop_reason": "stop" | "length", "tokens": [int], "logprobs": [float]}],
     "prompt_logprobs": [float | None] | None, "prompt_cache_hit_tokens": 0}

Refused with `SampleError` (the future fails with the SDK's `User` category, which it raises as
`RequestFailedError` without retrying): image chunks, `topk_prompt_logprobs` / `topk_sample_logprobs`
/ `target_prompt_logprobs` / `prompt_alt_tokens_k` / `record_stability_info` (not served here),
a `num_samples` or `max_tokens` out of range, an empty prompt.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from app.engines.client import EngineClient, EngineHTTPError

MAX_NUM_SAMPLES = 64  # one request's samples; each is a batch row of the engine


class SampleError(ValueError):
    """A sample request this server refuses: the message names the field (the SDK shows it)."""


@dataclass(frozen=True)
class SampleJob:
    """One parsed sample request (`parse_request`): `prompt` int token ids [P]."""

    prompt: list[int]
    num_samples: int
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop_strings: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    prompt_logprobs: bool
    prompt_logprobs_last_n: int | None


def _int(value: Any, name: str, default: int | None = None) -> int | None:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise SampleError(f"{name} must be an integer, got {value!r}")
    return value


def _float(value: Any, name: str, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SampleError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def prompt_tokens(model_input: Any) -> list[int]:
    """The token ids of a `ModelInput` JSON (`{"chunks": [{"type": "encoded_text", "tokens"}]}`),
    chunks concatenated.  Raises `SampleError` for a non-text chunk or a malformed one."""
    chunks = model_input.get("chunks") if isinstance(model_input, dict) else None
    if not isinstance(chunks, list):
        raise SampleError("prompt must be a ModelInput with a list of chunks")
    ids: list[int] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, dict) else None
        if kind != "encoded_text":
            raise SampleError(f"prompt.chunks[{i}] is a {kind or 'malformed'} chunk; this server samples text "
                              "models only (encoded_text chunks)")
        tokens = chunk.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise SampleError(f"prompt.chunks[{i}].tokens must be a list of token ids")
        ids.extend(tokens)
    return ids


def parse_request(payload: dict[str, Any]) -> SampleJob:
    """A `SampleRequest` JSON as a `SampleJob`.  Raises `SampleError` (see the module docstring)."""
    for field, off in (("topk_prompt_logprobs", 0), ("topk_sample_logprobs", 0), ("prompt_alt_tokens_k", 0),
                       ("target_prompt_logprobs", None), ("record_stability_info", None)):
        value = payload.get(field)
        if value not in (off, None, False):
            raise SampleError(f"{field} is not supported by this server (only the sampled tokens' logprobs and "
                              "prompt_logprobs are)")
    prompt = prompt_tokens(payload.get("prompt"))
    if not prompt:
        raise SampleError("prompt has no tokens")
    num_samples = _int(payload.get("num_samples"), "num_samples", 1)
    if not 1 <= num_samples <= MAX_NUM_SAMPLES:
        raise SampleError(f"num_samples must be between 1 and {MAX_NUM_SAMPLES}, got {num_samples}")
    params = payload.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise SampleError("sampling_params must be an object")
    max_tokens = _int(params.get("max_tokens"), "sampling_params.max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise SampleError(f"sampling_params.max_tokens must be at least 1, got {max_tokens}")
    temperature = _float(params.get("temperature"), "sampling_params.temperature", 1.0)
    top_p = _float(params.get("top_p"), "sampling_params.top_p", 1.0)
    top_k = _int(params.get("top_k"), "sampling_params.top_k", -1)
    if temperature < 0:
        raise SampleError(f"sampling_params.temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise SampleError(f"sampling_params.top_p must be in (0, 1], got {top_p}")
    stop = params.get("stop")
    stop_strings: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] = ()
    if isinstance(stop, str):
        stop_strings = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop_strings = tuple(s for s in stop if s)
    elif isinstance(stop, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        stop_ids = tuple(stop)
    elif stop is not None:
        raise SampleError("sampling_params.stop must be a string, a list of strings or a list of token ids")
    include = bool(payload.get("prompt_logprobs"))
    last_n = _int(payload.get("prompt_logprobs_last_n"), "prompt_logprobs_last_n")
    if last_n is not None and not (include and 1 <= last_n <= len(prompt) - 1):
        raise SampleError(f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {len(prompt) - 1} "
                          "and needs prompt_logprobs")
    return SampleJob(prompt, num_samples, max_tokens, temperature, top_p, top_k if top_k and top_k > 0 else 0,
                     _int(params.get("seed"), "sampling_params.seed"), stop_strings, stop_ids,
                     stop == [], include, last_n)


def completion_body(job: SampleJob, index: int, model: str | None) -> dict[str, Any]:
    """The engine's `/v1/completions` body for sample `index` of `job` (`model`: the adapter's
    served name, None for the base model)."""
    body: dict[str, Any] = {"prompt": job.prompt, "temperature": job.temperature, "top_p": job.top_p,
                            "top_k": job.top_k, "logprobs": 0, "return_token_ids": True,
                            "skip_special_tokens": False}
    if model:
        body["model"] = model
    if job.max_tokens is not None:
        body["max_tokens"] = job.max_tokens
    if job.seed is not None:
        body["seed"] = job.seed + index
    if job.stop_strings:
        body["stop"] = list(job.stop_strings)
    if job.stop_token_ids:
        body["stop_token_ids"] = list(job.stop_token_ids)
    if job.ignore_eos:
        body["ignore_eos"] = True
    return body


def _sequence(answer: dict[str, Any]) -> dict[str, Any]:
    choice = answer["choices"][0]
    tokens = [int(t) for t in choice["token_ids"]]
    logprobs = [float(v) for v in ((choice.get("logprobs") or {}).get("token_logprobs") or [])]
    if len(logprobs) != len(tokens):
        raise RuntimeError(f"the engine returned {len(tokens)} token ids but {len(logprobs)} logprobs")
    # "stop": a stop token or string ended it; anything else (length, an abort) is "length" to the SDK.
    return {"tokens": tokens, "logprobs": logprobs,
            "stop_reason": "stop" if choice.get("finish_reason") == "stop" else "length"}


def score_prompt(client: EngineClient, job: SampleJob, model: str | None) -> list[float | None]:
    """Logprob of each prompt token given the ones before it (None at position 0, and before the
    last `prompt_logprobs_last_n` when set), under `model`."""
    body: dict[str, Any] = {"prompt": job.prompt, "prompt_logprobs": 0, "max_tokens": 1}
    if model:
        body["model"] = model
    entries = client.request("POST", "/v1/completions", body)["choices"][0]["prompt_logprobs"]
    out: list[float | None] = [None]
    for token, entry in zip(job.prompt[1:], entries[1:]):
        out.append(float(entry[str(token)]["logprob"]))
    if job.prompt_logprobs_last_n is not None:
        keep_from = len(out) - job.prompt_logprobs_last_n
        out = [None] * keep_from + out[keep_from:]
    return out


def sample(client: EngineClient, job: SampleJob, model: str | None) -> dict[str, Any]:
    """`job` answered by the engine behind `client` under `model` (module docstring's result).

    Raises:
        SampleError: the engine refused the request as the caller's (4xx: too long a prompt, an
            id outside the vocabulary); its message is kept.
        EngineHTTPError / EngineConnectionError: the engine failed (5xx, unreachable).
    """
    calls = job.num_samples + (1 if job.prompt_logprobs else 0)
    try:
        with ThreadPoolExecutor(max_workers=min(calls, 16), thread_name_prefix="tinker-sample") as pool:
            answers = [pool.submit(client.request, "POST", "/v1/completions", completion_body(job, i, model))
                       for i in range(job.num_samples)]
            scored = pool.submit(score_prompt, client, job, model) if job.prompt_logprobs else None
            sequences = [_sequence(a.result()) for a in answers]
            prompt_logprobs = scored.result() if scored is not None else None
    except EngineHTTPError as exc:
        if 400 <= exc.status < 500 and exc.status != 404:
            raise SampleError(f"the engine refused the request: {exc.message}") from exc
        raise
    return {"sequences": sequences, "prompt_logprobs": prompt_logprobs, "prompt_cache_hit_tokens": 0}
