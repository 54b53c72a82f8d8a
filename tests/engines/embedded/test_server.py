"""The engine contract over real HTTP against a real engine subprocess (tiny model)."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest
import torch

from app.engines.client import EngineHTTPError
from app.engines.modeling import build_tiny_model, load_tokenizer
from app.engines.transform import processed_logprobs
from app.engines.embedded.templates import render_prompt

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


def recompute_logprobs(model, prompt_ids: list[int], token_ids: list[int], temperature: float = 1.0,
                       support: list[int] | None = None) -> torch.Tensor:
    """Trainer-side recomputation: one plain fp32 forward pass over prompt + completion, scored
    under the sampling transform the tokens were drawn with (`app.engines.transform`)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0].float()[len(prompt_ids) - 1:-1]
    n = len(token_ids)
    return processed_logprobs(logits, torch.tensor(token_ids), torch.full((n,), temperature),
                              torch.tensor(support) if support is not None else None)


def test_prompt_token_ids_equal_tokenizer_rendering(engine):
    tokenizer = load_tokenizer()
    out = engine.client.chat(MESSAGES, max_tokens=3, return_token_ids=True, seed=0)
    expected = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert out["prompt_token_ids"] == list(expected)
    assert engine.client.tokenize(MESSAGES) == list(expected)
    assert out["usage"] == {"prompt_tokens": len(expected), "completion_tokens": 3, "total_tokens": len(expected) + 3}
    assert out["policy_version"] == 0 and out["engine_id"]
    assert engine.client.detokenize(out["choices"][0]["token_ids"]) == out["choices"][0]["message"]["content"]


def test_logprob_parity_non_stream_and_stream(engine):
    """Recorded logprobs (under temperature 0.8 and top-p 0.9, with the support each token reports)
    equal the trainer's recomputation (goal < 1e-4), in both modes."""
    model = build_tiny_model(0)
    worst = 0.0
    for stream in (False, True):
        fields = dict(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, logprobs=True,
                      return_token_ids=True, ignore_eos=True)
        if stream:
            chunks = list(engine.client.chat(MESSAGES, stream=True, **fields))
            prompt_ids = chunks[0]["prompt_token_ids"]
            token_ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
            entries = [e for c in chunks for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
        else:
            out = engine.client.chat(MESSAGES, **fields)
            prompt_ids, token_ids = out["prompt_token_ids"], out["choices"][0]["token_ids"]
            entries = out["choices"][0]["logprobs"]["content"]
        logprobs = [e["logprob"] for e in entries]
        assert len(token_ids) == len(logprobs) == 24
        recomputed = recompute_logprobs(model, prompt_ids, token_ids, 0.8, [e["support"] for e in entries])
        diff = (recomputed - torch.tensor(logprobs)).abs().max().item()
        worst = max(worst, diff)
    print(f"tiny engine logprob parity: max abs diff {worst:.2e}")
    assert worst < 1e-4


def test_seeded_sampling_is_reproducible_and_stream_matches(engine):
    fields = dict(max_tokens=12, temperature=1.0, seed=123, return_token_ids=True, ignore_eos=True)
    a = engine.client.chat(MESSAGES, **fields)["choices"][0]["token_ids"]
    b = engine.client.chat(MESSAGES, **fields)["choices"][0]["token_ids"]
    c = [t for chunk in engine.client.chat(MESSAGES, stream=True, **fields)
         for ch in chunk["choices"] for t in ch.get("token_ids", [])]
    other = engine.client.chat(MESSAGES, **{**fields, "seed": 124})["choices"][0]["token_ids"]
    assert a == b == c
    assert other != a


def test_concurrent_requests_are_batched_and_exact(engine):
    """Eight concurrent requests of different lengths; each one's logprobs match a lone forward pass."""
    model = build_tiny_model(0)
    results: dict[int, dict] = {}

    def one(i: int) -> None:
        messages = [{"role": "user", "content": "word " * (1 + 5 * i)}]
        results[i] = engine.client.chat(messages, max_tokens=10 + i, seed=i, logprobs=True,
                                        return_token_ids=True, ignore_eos=True)

    before = engine.client.health()["decode_steps"]
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    steps = engine.client.health()["decode_steps"] - before
    total = sum(len(r["choices"][0]["token_ids"]) for r in results.values())
    assert total == sum(10 + i for i in range(8))
    assert steps < total - 8, f"{steps} decode steps for {total} tokens: requests were not batched"
    worst = max((recompute_logprobs(model, r["prompt_token_ids"], r["choices"][0]["token_ids"])
                 - torch.tensor([e["logprob"] for e in r["choices"][0]["logprobs"]["content"]])).abs().max().item()
                for r in results.values())
    print(f"batched logprob parity: max abs diff {worst:.2e} over {total} tokens in {steps} steps")
    assert worst < 1e-4


def test_stop_string_and_max_tokens(engine):
    full = engine.client.chat(MESSAGES, max_tokens=8, seed=5, return_token_ids=True, ignore_eos=True)
    text = full["choices"][0]["message"]["content"]
    assert full["choices"][0]["finish_reason"] == "length"
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    cut = engine.client.chat(MESSAGES, max_tokens=8, seed=5, stop=[stop], return_token_ids=True, ignore_eos=True)
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["message"]["content"] == text[: text.find(stop)]
    assert choice["token_ids"] == full["choices"][0]["token_ids"][: len(choice["token_ids"])]


def test_context_limit_is_a_400_with_vllm_wording(engine):
    with pytest.raises(EngineHTTPError) as err:
        engine.client.chat(MESSAGES, max_tokens=8190)
    assert err.value.status == 400
    message = err.value.body["error"]["message"]
    assert message.startswith("This model's maximum context length is 8192 tokens. However, you requested")
    assert "in the messages, 8190 in the completion" in message
    long = [{"role": "user", "content": "hello " * 9000}]
    with pytest.raises(EngineHTTPError) as err:
        engine.client.chat(long, max_tokens=1)
    assert err.value.status == 400 and "maximum context length is 8192" in err.value.body["error"]["message"]


@pytest.mark.parametrize("body,needle", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": MESSAGES, "n": 2}, "n=1"),
    ({"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ({"messages": MESSAGES, "top_logprobs": 50, "logprobs": True}, "top_logprobs"),
])
def test_bad_requests_get_400_in_openai_error_shape(engine, body, needle):
    response = httpx.post(f"{engine.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    assert needle in error["message"] and error["code"] == 400 and error["type"] == "BadRequestError"


def test_tools_are_rendered_with_the_tool_template(engine):
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                               "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
    out = engine.client.chat(MESSAGES, tools=tools, max_tokens=2, return_token_ids=True)
    assert out["prompt_token_ids"] == render_prompt(load_tokenizer(), MESSAGES, tools)
    assert "<tools>" in engine.client.detokenize(out["prompt_token_ids"])


def test_models_health_and_version_routes(engine):
    models = httpx.get(f"{engine.url}/v1/models").json()
    assert models["data"][0]["max_model_len"] == 8192
    assert engine.client.policy_version() == engine.client.health()["policy_version"]


def test_openai_sdk_against_engine(engine):
    """The real openai SDK, stream and non-stream, with vLLM extension fields via extra_body."""
    client = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="unused")
    out = client.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=4, seed=1,
                                         logprobs=True, top_logprobs=3,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    extra = out.model_extra
    assert out.model == "anything" and out.choices[0].finish_reason == "length"
    assert len(out.choices[0].logprobs.content) == 4
    assert len(out.choices[0].logprobs.content[0].top_logprobs) == 3
    assert extra["prompt_token_ids"] and extra["policy_version"] == 0
    chunks = list(client.chat.completions.create(model="anything", messages=MESSAGES, max_tokens=4, seed=1,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True, "ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []
    client.close()


def _assert_generation_stopped(engine, before: int) -> None:
    """Nothing waits, prefills or runs within 30 s, and fewer than the 3000 asked-for tokens were
    generated since `before` (the engine's `generated_tokens` counter)."""
    import time

    def in_flight(h: dict) -> int:  # the request may still be prefilling when the client leaves
        return h["waiting"] + h["prefilling"] + h["running"]

    deadline = time.monotonic() + 30
    while in_flight(engine.client.health()) and time.monotonic() < deadline:
        time.sleep(0.05)
    health = engine.client.health()
    assert in_flight(health) == 0, health
    assert health["generated_tokens"] - before < 3000, health


def test_client_disconnect_frees_the_batch_slot(engine):
    """Closing a stream mid-way cancels generation instead of running to max_tokens."""
    before = engine.client.health()["generated_tokens"]
    with httpx.stream("POST", f"{engine.url}/v1/chat/completions", timeout=60,
                      json={"messages": MESSAGES, "stream": True, "max_tokens": 3000, "ignore_eos": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    _assert_generation_stopped(engine, before)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_non_stream_client_disconnect_frees_the_batch_slot(engine, route):
    """A non-stream client that gives up (read timeout, connection closed) cancels generation, on
    both generating routes: the engine looks at the client's socket while it generates, as vLLM's
    non-stream routes do."""
    before = engine.client.health()["generated_tokens"]
    prompt = {"messages": MESSAGES} if route == "/v1/chat/completions" else {"prompt": "Once upon a time"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{engine.url}{route}", timeout=1.0, json={**prompt, "max_tokens": 3000, "ignore_eos": True})
    _assert_generation_stopped(engine, before)


def test_completions_with_token_id_prompt_is_exact(engine):
    """Tokens in, tokens out: /v1/completions takes the rendered ids verbatim; stream = non-stream."""
    prompt_ids = engine.client.tokenize(MESSAGES)
    body = {"prompt": prompt_ids, "max_tokens": 10, "seed": 9, "logprobs": 2, "return_token_ids": True,
            "ignore_eos": True}
    out = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=60).json()
    choice = out["choices"][0]
    assert out["object"] == "text_completion" and out["prompt_token_ids"] == prompt_ids
    assert len(choice["token_ids"]) == 10 and len(choice["logprobs"]["top_logprobs"][0]) == 2
    diff = (recompute_logprobs(build_tiny_model(0), prompt_ids, choice["token_ids"])
            - torch.tensor(choice["logprobs"]["token_logprobs"])).abs().max().item()
    assert diff < 1e-4
    chat = engine.client.chat(MESSAGES, max_tokens=10, seed=9, return_token_ids=True, ignore_eos=True)
    assert chat["choices"][0]["token_ids"] == choice["token_ids"]  # same ids as the chat path
    with httpx.stream("POST", f"{engine.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    import json

    chunks = [json.loads(f) for f in frames[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    bad = httpx.post(f"{engine.url}/v1/completions", json={"prompt": [10**9]}, timeout=30)
    assert bad.status_code == 400 and "prompt" in bad.json()["error"]["message"]


def test_second_turn_reuses_the_prefix_cache_exactly(engine):
    """Turn 2 re-sends turn 1: its prefill starts after the cached prefix and logprobs stay exact."""
    model = build_tiny_model(0)
    fields = dict(max_tokens=6, seed=4, logprobs=True, return_token_ids=True, ignore_eos=True)
    first = engine.client.chat(MESSAGES, **fields)
    hits_before = engine.client.health()["prefix_hit_tokens"]
    history = MESSAGES + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                          {"role": "user", "content": "And again?"}]
    second = engine.client.chat(history, **fields)
    reused = engine.client.health()["prefix_hit_tokens"] - hits_before
    assert reused >= len(first["prompt_token_ids"])
    choice = second["choices"][0]
    diff = (recompute_logprobs(model, second["prompt_token_ids"], choice["token_ids"])
            - torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])).abs().max().item()
    print(f"prefix-cache hit of {reused} tokens; logprob max abs diff {diff:.2e}")
    assert diff < 1e-4


def test_procfile_engine_runs_under_gunicorn(spawn):
    """The Procfile's `engine` line (gunicorn, workers/engine_conf.py, through the launcher) serves
    the engine contract: a chat answer with token ids, and the stable engine id host-port."""
    import shlex
    import socket

    from support import ROOT, free_port, wait_for

    line = next(ln for ln in (ROOT / "Procfile").read_text().splitlines() if ln.startswith("engine:"))
    argv = shlex.split(line.split(":", 1)[1])
    assert "gunicorn" in argv[argv.index("workers.launch") + 1]
    port = free_port()
    proc = spawn(argv, {"TURNSTILE_ENGINE_PORT": str(port), "TURNSTILE_ENGINE_MODEL": "tiny"}, name="engine")
    url = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, 120, what=f"the Procfile engine to answer\n{proc.output()[-2000:]}")
    answer = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "return_token_ids": True}).json()
    assert len(answer["choices"][0]["token_ids"]) == 4 and answer["prompt_token_ids"]
    assert answer["engine_id"] == f"embedded-{socket.gethostname()}-{port}"
    assert "gunicorn" in proc.output()
