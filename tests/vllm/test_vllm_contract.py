"""The engine contract against the real vLLM server (CPU build, SmolLM2, fp32): what the gateway
and the trainer rely on, checked on vLLM itself instead of the embedded engine.

Logprob figures are printed (run with ``-s`` to see them): vLLM's sampled-token logprobs
against the trainer's recomputation (one fp32 transformers forward pass in Turnstile's venv).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

from app.engines.client import EngineClient, EngineHTTPError
from app.engines.modeling import load_model, load_tokenizer, save_weights
from app.engines.vllm import VLLMReloader
from app.proxy.errors import parse_context_overflow

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
PROMPTS = [MESSAGES, [{"role": "user", "content": "Write one sentence about the sea."}],
           [{"role": "user", "content": "def add(a, b):\n    return a + b\n\nExplain this code."}]]
MODEL = "policy"   # --served-model-name of serve_command


@pytest.fixture(scope="module")
def trainer_model():
    """SmolLM2 as the trainer loads it (fp32, eval mode), from the same safetensors cache."""
    model, _tokenizer = load_model("smollm2")
    return model.eval()


def recompute(model, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """Trainer-side logprobs of ``token_ids`` after ``prompt_ids``: one fp32 forward pass, [T] float32."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt_ids) - 1:-1].gather(1, torch.tensor(token_ids)[:, None])[:, 0]


def sampled(out: dict) -> tuple[list[int], list[int], torch.Tensor]:
    """(prompt ids, sampled ids, their logprobs) of a non-stream vLLM answer."""
    choice = out["choices"][0]
    return (out["prompt_token_ids"], choice["token_ids"],
            torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]]))


def fields(**extra):
    return {**dict(model=MODEL, max_tokens=16, temperature=1.0, seed=7, logprobs=True, return_token_ids=True,
                   ignore_eos=True), **extra}


def test_token_ids_out_and_tokenize_equal_the_trainer_tokenization(vllm_server):
    tokenizer = load_tokenizer()
    out = vllm_server.client.chat(MESSAGES, model=MODEL, max_tokens=4, seed=0, ignore_eos=True, return_token_ids=True)
    expected = list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False))
    assert out["prompt_token_ids"] == expected
    assert vllm_server.client.tokenize(MESSAGES, model=MODEL) == expected
    ids = out["choices"][0]["token_ids"]
    assert len(ids) == 4 and out["usage"]["prompt_tokens"] == len(expected)
    assert vllm_server.client.detokenize(ids) == out["choices"][0]["message"]["content"] == tokenizer.decode(ids)
    models = vllm_server.client.models()
    assert models[0]["id"] == MODEL and models[0]["max_model_len"] == 8192


def test_token_ids_in_are_the_prompt(vllm_server):
    """A pre-tokenized chat prompt (vLLM 0.32: ``kv_transfer_params.prompt_token_ids``) is served
    as given: the answer equals the one for the same prompt rendered from text, under a seed."""
    tokenizer = load_tokenizer()
    ids = list(tokenizer.apply_chat_template(PROMPTS[1], add_generation_prompt=True, return_dict=False))
    from_text = vllm_server.client.chat(PROMPTS[1], **fields(max_tokens=6))
    # `messages` differ on purpose: the ids, not the text, must be what the model sees.
    from_ids = vllm_server.client.chat(MESSAGES, kv_transfer_params={"prompt_token_ids": ids}, **fields(max_tokens=6))
    assert from_ids["prompt_token_ids"] == ids == from_text["prompt_token_ids"]
    assert from_ids["choices"][0]["token_ids"] == from_text["choices"][0]["token_ids"]


def test_stream_equals_non_stream_under_a_seed(vllm_server):
    f = fields(max_tokens=12)
    a = vllm_server.client.chat(MESSAGES, **f)
    chunks = list(vllm_server.client.chat(MESSAGES, stream=True, **f))
    stream_ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    stream_lps = [e["logprob"] for c in chunks for ch in c["choices"] if ch.get("logprobs")
                  for e in ch["logprobs"]["content"]]
    other = vllm_server.client.chat(MESSAGES, **{**f, "seed": 8})
    _, ids, lps = sampled(a)
    assert chunks[0]["prompt_token_ids"] == a["prompt_token_ids"]
    assert stream_ids == ids and len(ids) == 12
    assert torch.allclose(torch.tensor(stream_lps), lps, atol=1e-5)
    assert other["choices"][0]["token_ids"] != ids


def test_tool_call_goes_through_the_hermes_parser(vllm_server):
    """SmolLM2 rarely emits a tool call by itself, so the output is constrained to one with a
    regex (vLLM structured outputs); the hermes parser must turn it into OpenAI ``tool_calls``."""
    tools = [{"type": "function", "function": {
        "name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
    regex = r'<tool_call>\n\{"name": "read_file", "arguments": \{"path": "a\.py"\}\}\n</tool_call>'
    out = vllm_server.client.chat([{"role": "user", "content": "Read a.py"}], model=MODEL, tools=tools,
                                  max_tokens=80, temperature=0, return_token_ids=True,
                                  structured_outputs={"regex": regex})
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "read_file" and call["id"]
    assert call["function"]["arguments"] == '{"path": "a.py"}'
    assert not choice["message"]["content"]
    # The sampled ids hold the raw text the parser read.
    assert vllm_server.client.detokenize(choice["token_ids"]).startswith("<tool_call>")


def test_context_overflow_is_a_400_the_gateway_reads(vllm_server):
    long = [{"role": "user", "content": "hello " * 9000}]
    with pytest.raises(EngineHTTPError) as err:
        vllm_server.client.chat(long, model=MODEL, max_tokens=1)
    assert err.value.status == 400
    prompt_tokens, max_context = parse_context_overflow(err.value.message)
    assert max_context == 8192 and prompt_tokens > 8192, err.value.message


def test_sampled_logprobs_equal_the_trainer_recomputation(vllm_server, trainer_model):
    """Goal < 1e-3 in fp32 (both sides fp32; vLLM's CPU kernels vs transformers' eager path)."""
    diffs = []
    for i, prompt in enumerate(PROMPTS):
        prompt_ids, ids, lps = sampled(vllm_server.client.chat(prompt, **fields(max_tokens=24, seed=i)))
        assert len(ids) == len(lps) == 24
        diffs.append((recompute(trainer_model, prompt_ids, ids) - lps).abs())
    diff = torch.cat(diffs)
    print(f"\nvLLM (CPU, fp32) vs trainer logprobs over {diff.numel()} sampled tokens: "
          f"max |Δ| {diff.max().item():.2e}, mean |Δ| {diff.mean().item():.2e}")
    assert diff.max().item() < 1e-3


def _perturbed(model, seed: int, scale: float = 0.02):
    """A copy of ``model`` with every weight moved by ``scale`` of its own std (seeded)."""
    import copy

    new = copy.deepcopy(model)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for p in new.parameters():
            p.add_(torch.randn_like(p) * scale * (p.std() + 1e-3))
    return new


@pytest.mark.vllm_alone
def test_weight_update_through_the_reloader_is_followed_and_holds_requests(vllm_server, trainer_model, tmp_path):
    """``VLLMReloader`` in mode ``wait``: pause → load on every worker → reset prefix cache → resume.
    A stream running when the reload starts finishes on the old weights; a request sent while
    the server is paused is held and answered on the new ones; nothing fails."""
    new_model = _perturbed(trainer_model, seed=11)
    checkpoint = save_weights(new_model, tmp_path / "step-1", {"policy_version": 1})
    try:
        _reload_while_serving(vllm_server, trainer_model, new_model, checkpoint)
    finally:   # back to the base weights for the rest of the session (the server is shared)
        restore = VLLMReloader(vllm_server.url)
        try:
            restore.reload(str(vllm_server.model_dir), 0)
        finally:
            restore.close()
    prompt_ids, ids, lps = sampled(vllm_server.client.chat(PROMPTS[1], **fields(max_tokens=8)))
    assert (recompute(trainer_model, prompt_ids, ids) - lps).abs().max().item() < 1e-3


def _reload_while_serving(vllm_server, trainer_model, new_model, checkpoint) -> None:
    prompt = PROMPTS[1]
    slow = EngineClient(vllm_server.url, timeout=600)
    reloader = VLLMReloader(vllm_server.url)
    try:
        stream = slow.chat(prompt, stream=True, **fields(max_tokens=32, seed=3))
        chunks = [next(stream)]
        result: dict = {}
        loading = threading.Thread(target=lambda: result.setdefault(
            "reload", reloader.reload(str(checkpoint), 1, mode="wait")))
        loading.start()
        deadline = time.monotonic() + 60
        while not vllm_server.client.request("GET", "/is_paused").get("is_paused"):
            assert loading.is_alive() and time.monotonic() < deadline, "the server never paused"
            time.sleep(0.05)
        held: dict = {}
        arriving = threading.Thread(target=lambda: held.setdefault("out", vllm_server.client.chat(
            prompt, **fields(max_tokens=8, seed=5))))
        arriving.start()
        chunks += list(stream)
        loading.join(300)
        arriving.join(300)
    finally:
        slow.close()
        reloader.close()
    assert result["reload"]["paused"] is True and result["reload"]["policy_version"] == 1
    print(f"\nvLLM (CPU) reload through VLLMReloader: {result['reload']}")
    # The running stream was not cut, and was sampled from the old weights.
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    lps = torch.tensor([e["logprob"] for c in chunks for ch in c["choices"] if ch.get("logprobs")
                        for e in ch["logprobs"]["content"]])
    assert len(ids) == 32 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert (recompute(trainer_model, chunks[0]["prompt_token_ids"], ids) - lps).abs().max().item() < 1e-3
    # The held request was answered after the load, by the new weights.
    prompt_ids, new_ids, new_lps = sampled(held["out"])
    new_diff = (recompute(new_model, prompt_ids, new_ids) - new_lps).abs().max().item()
    old_diff = (recompute(trainer_model, prompt_ids, new_ids) - new_lps).abs().max().item()
    print(f"after reload: max |Δ| vs new weights {new_diff:.2e}, vs old weights {old_diff:.2e}")
    assert new_diff < 1e-3 and old_diff > 1e-2


@pytest.mark.vllm_alone
@pytest.mark.parametrize("clear_cache", [True, False])
def test_keep_update_continues_a_running_stream_on_the_new_weights(vllm_server, trainer_model, tmp_path, clear_cache):
    """``VLLMReloader`` in mode ``keep`` (``/pause?mode=keep&clear_cache=…``): a stream running when
    the update starts is neither drained nor cut; the gateway's stamping (each chunk's arrival
    against the recorded pause, ``app.versions.from_arrivals``) splits it into a version-0 head that
    the old weights sampled and a version-1 tail that the new weights sampled.  With clear_cache
    the tail's logprobs are the new weights' over the whole context; without it the KV of the head
    stays stale and the tail differs from a fresh recompute."""
    from app import versions, weight_gate

    new_model = _perturbed(trainer_model, seed=12)
    checkpoint = save_weights(new_model, tmp_path / "step-1", {"policy_version": 1})
    weight_gate.get_redis().delete(weight_gate.updates_key(vllm_server.url))
    client = EngineClient(vllm_server.url, timeout=600)
    reloader = VLLMReloader(vllm_server.url)
    try:
        stream = client.chat(PROMPTS[2], stream=True, **fields(max_tokens=160, seed=4))
        chunks, arrivals, ids = [], [], []
        started = threading.Event()

        def read() -> None:  # read as the gateway does: all the time, stamping each chunk's arrival
            for chunk in stream:
                chunks.append(chunk)
                new_ids = [t for ch in chunk["choices"] for t in ch.get("token_ids") or []]
                if new_ids:
                    arrivals.append((len(ids), time.time()))
                    ids.extend(new_ids)
                if len(ids) >= 8:
                    started.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert started.wait(300), "the stream did not start"
        receipt = reloader.reload(str(checkpoint), 1, mode="keep", recompute_kv=clear_cache)
        reader.join(600)
        restore = VLLMReloader(vllm_server.url)
        try:
            restore.reload(str(vllm_server.model_dir), 0)
        finally:
            restore.close()
    finally:
        client.close()
        reloader.close()
    assert receipt["paused"] is True and receipt["mode"] == "keep"
    assert len(ids) == 160 and chunks[-1]["choices"][0]["finish_reason"] == "length"
    lps = torch.tensor([e["logprob"] for c in chunks for ch in c["choices"] if ch.get("logprobs")
                        for e in ch["logprobs"]["content"]])
    runs = versions.from_arrivals(arrivals, len(ids), weight_gate.recorded_updates(vllm_server.url)[:1], 0)
    assert len(runs) == 2 and runs[0] == [0, 0] and runs[1][1] == 1, runs
    switch = runs[1][0]
    assert 8 <= switch < 160, runs
    prompt_ids = chunks[0]["prompt_token_ids"]
    head = (recompute(trainer_model, prompt_ids, ids[:switch]) - lps[:switch]).abs().max().item()
    tail = (recompute(new_model, prompt_ids, ids)[switch:] - lps[switch:]).abs().max().item()
    print(f"\nvLLM keep (clear_cache={clear_cache}) at token {switch}: head vs old {head:.2e}, tail vs new {tail:.2e}")
    assert head < 1e-3
    if clear_cache:
        assert tail < 1e-3
    else:
        assert tail > 1e-3  # the tail attended to KV the old weights computed


@pytest.mark.vllm_alone
def test_the_watchdog_resumes_a_server_a_dead_reloader_left_paused(vllm_server):
    """What a trainer killed between ``/pause`` and ``/resume`` leaves behind: the real server
    paused (``keep``) and the reloader's pause record in Redis.  The watchdog's check leaves it
    alone while the record is within its deadline, then resumes it (``POST /resume``) and forgets
    the record, and the server answers again."""
    from app import weight_gate
    from app.control.engine_pauses import resume_stale_pauses

    client, url = vllm_server.client, vllm_server.url
    record = weight_gate.record_pause(url, 99, time.time())
    client.request("POST", "/pause", params={"mode": "keep", "clear_cache": "false"})
    try:
        assert client.request("GET", "/is_paused")["is_paused"] is True
        assert url not in resume_stale_pauses(timeout_s=3600.0)  # within its deadline: left to its reloader
        assert client.request("GET", "/is_paused")["is_paused"] is True
        assert resume_stale_pauses(timeout_s=0.0)[url] == "resumed"
        assert client.request("GET", "/is_paused")["is_paused"] is False
        assert url not in weight_gate.recorded_pauses()
        out = client.chat(MESSAGES, **fields(max_tokens=3))
        assert len(out["choices"][0]["token_ids"]) == 3
    finally:
        client.request("POST", "/resume")
        weight_gate.clear_pause(url, record)
