"""LoRA train runs' adapters served per request by a real vLLM server (CPU build, SmolLM2, fp32,
``--enable-lora``, a server of this module's own: `support.vllm_server` says why): the trainer's
adapter folder loads as it is written, answers under it are the trainer's model with that
adapter, names carry versions, the prefix cache never crosses adapters or versions, and an
adapter the server lost is loaded again on demand."""
from __future__ import annotations

import copy

import pytest
import torch

from app.db import session_scope
from app.engines.client import EngineHTTPError
from app.engines.embedded.adapters import peft_weights, save_adapter
from app.engines.lora_format import adapter_name
from app.engines.modeling import load_model
from app.engines.vllm.lora import VLLMAdapterError, load_adapter, served_adapters, unload_adapter
from app.proxy.errors import GatewayError
from app.proxy.upstream import EngineTarget, StreamHandle, Upstream
from app.tables import Run, TrainingStep
from app.training import policy
from support.vllm_server import VLLMServer

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Write one sentence about the sea."}]
TARGETS = ("q_proj", "v_proj")  # a small adapter: quick to write and load


@pytest.fixture(scope="module")
def lora_server():
    """vLLM with --enable-lora --max-loras 2 --max-lora-rank 16 (about a minute to start)."""
    server = VLLMServer(lora=True)
    try:
        server.wait()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def base_model():
    model, _tokenizer = load_model("smollm2")
    return model.eval()


def trained_adapter(base, folder, seed: int, label: str = "run-7", r: int = 8):
    """A LoRA on SmolLM2 with random nonzero B (as after training), saved as the trainer saves a
    step's adapter folder; returns (served name, the merged model: the reference)."""
    model = policy.add_lora(copy.deepcopy(base), r, 2 * r, 0.0, targets=TARGETS)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.05)
    save_adapter(folder, peft_weights({k: v for k, v in model.state_dict().items() if "lora_" in k}), r, 2 * r, seed)
    return adapter_name(label, folder), model.merge_and_unload().eval()


def greedy(client, model: str, messages=PROMPT, tokens: int = 12) -> dict:
    return client.chat(messages, model=model, max_tokens=tokens, temperature=0.0, logprobs=True,
                       return_token_ids=True, ignore_eos=True)


def logprob_gap(reference, out: dict) -> float:
    """max |vLLM's sampled-token logprob − `reference`'s fp32 recomputation| of one answer."""
    choice = out["choices"][0]
    prompt, ids = out["prompt_token_ids"], choice["token_ids"]
    served = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + ids])).logits[0].float()
    recomputed = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(ids)[:, None])[:, 0]
    return (recomputed - served).abs().max().item()


def cached(out: dict) -> int:
    return int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_each_request_samples_from_the_adapter_it_names(lora_server, base_model, tmp_path):
    name_a, merged_a = trained_adapter(base_model, tmp_path / "a", seed=1)
    name_b, merged_b = trained_adapter(base_model, tmp_path / "b", seed=2, label="run-8")
    client = lora_server.client
    for name in (name_a, name_b):
        load_adapter(client, name, tmp_path / ("a" if name == name_a else "b"))
    assert {name_a, name_b} <= set(served_adapters(client))
    out_a, out_b, out_base = greedy(client, name_a), greedy(client, name_b), greedy(client, "policy")
    gaps = {"a": logprob_gap(merged_a, out_a), "b": logprob_gap(merged_b, out_b),
            "a under b": logprob_gap(merged_b, out_a), "a under base": logprob_gap(base_model, out_a)}
    print(f"\nvLLM LoRA answers vs the trainer's merged adapters (max |Δ logprob|): {gaps}")
    assert gaps["a"] < 1e-3 and gaps["b"] < 1e-3  # the PEFT folder vLLM read is the trainer's adapter
    assert gaps["a under b"] > 1e-2 and gaps["a under base"] > 1e-2  # and the adapters do differ
    assert logprob_gap(base_model, out_base) < 1e-3  # a request naming no adapter still samples the base


def test_the_prefix_cache_is_keyed_by_adapter_and_version(lora_server, base_model, tmp_path):
    """A long shared prompt: cached once under A; B, and A's next version, must compute it again."""
    messages = [{"role": "system", "content": "You review code. " * 60}, {"role": "user", "content": "Say hi."}]
    name_a1, _ = trained_adapter(base_model, tmp_path / "a1", seed=11, label="run-9")
    name_a2, _ = trained_adapter(base_model, tmp_path / "a2", seed=12, label="run-9")
    name_b, _ = trained_adapter(base_model, tmp_path / "b", seed=13, label="run-10")
    client = lora_server.client
    for name, folder in ((name_a1, "a1"), (name_b, "b"), (name_a2, "a2")):
        load_adapter(client, name, tmp_path / folder)
    greedy(client, name_a1, messages, tokens=1)
    again = greedy(client, name_a1, messages, tokens=1)
    assert cached(again) >= 256  # the cache works under one adapter (the check below can fail)
    assert cached(greedy(client, name_b, messages, tokens=1)) == 0
    assert cached(greedy(client, name_a2, messages, tokens=1)) == 0


def test_a_run_keeps_two_versions_and_a_lost_adapter_is_loaded_again_on_demand(
        lora_server, base_model, tmp_path, database):
    client = lora_server.client
    with session_scope() as s:
        run = Run(kind="train", config={"kind": "train", "training": {"lora": True}}, status="running")
        s.add(run)
        s.flush()
        run_id = run.id
    label = f"run-{run_id}"
    names = []
    for step in range(3):
        folder = tmp_path / f"checkpoint-{step}" / "adapter"
        name, _ = trained_adapter(base_model, folder, seed=20 + step, label=label)
        names.append(name)
        with session_scope() as s:
            s.add(TrainingStep(run_id=run_id, step=step, status="completed", policy_version=step + 1,
                               checkpoint_path=str(folder.parent), metrics={"adapter": name}))
        dropped = load_adapter(client, name, folder)
        assert dropped == ([names[0]] if step == 2 else [])
    assert [n for n in served_adapters(client) if n.startswith(label + "@")] == names[1:]
    assert load_adapter(client, names[2], tmp_path / "checkpoint-2" / "adapter") == []  # a second load: a no-op
    with pytest.raises(EngineHTTPError) as lost:
        greedy(client, names[0])
    assert lost.value.status == 404 and "does not exist" in lost.value.message

    # The gateway's engine side: a session still on the unloaded version gets its answer, in
    # both the non-stream and the stream path; the adapter is served again afterwards.
    up = Upstream([lora_server.url])
    engine = EngineTarget(lora_server.url)
    body = {"model": names[0], "messages": PROMPT, "max_tokens": 4, "temperature": 0.0, "logprobs": True,
            "return_token_ids": True}
    answer = up.complete(engine, dict(body), None)
    assert len(answer["choices"][0]["token_ids"]) == 4 and names[0] in served_adapters(client)
    assert unload_adapter(client, names[0]) and not unload_adapter(client, names[0])
    opening = up.open_stream(engine, dict(body, stream=True), None, wait_s=60)
    assert isinstance(opening.result, StreamHandle), opening.result
    opening.result.close()
    assert names[0] in served_adapters(client)
    # A name no kept checkpoint made stays the engine's 404, in the caller's shape.
    ghost = f"{label}@{'0' * 12}"
    with pytest.raises(GatewayError) as missing:
        up.complete(engine, dict(body, model=ghost), None)
    assert missing.value.kind == "upstream" and "does not exist" in str(missing.value)


def test_an_adapter_vllm_cannot_serve_is_refused_with_its_cause(lora_server, base_model, tmp_path):
    big, _ = trained_adapter(base_model, tmp_path / "big", seed=3, label="run-11", r=32)  # > --max-lora-rank 16
    with pytest.raises(VLLMAdapterError) as refused:
        load_adapter(lora_server.client, big, tmp_path / "big")
    assert "rank" in str(refused.value).lower() and big not in served_adapters(lora_server.client)
    with pytest.raises(VLLMAdapterError, match="adapter_config.json"):
        load_adapter(lora_server.client, big, tmp_path)  # not an adapter folder


def test_a_lora_train_step_serves_its_adapter_on_vllm_and_the_watchdog_restores_it(
        lora_server, base_model, var_dir, data, one_thread):
    """`train_step` of a LoRA run on vLLM engines: the step's adapter (never merged full weights)
    is what vLLM serves under the step's name, and after a restart-like loss the watchdog loads it
    again."""
    from peft import PeftModel

    from app.control import engine_resync
    from app.training import steps

    run = data.run([lora_server.url], {"lora": True, "lora_r": 8, "lora_alpha": 16, "learning_rate": 1e-2,
                                       "lora_target_modules": list(TARGETS), "seed": 5})
    with session_scope() as s:
        row = s.get(Run, run)
        row.config = {**row.config, "model": {"name": "smollm2", "engine": "vllm", "engine_urls": [lora_server.url]}}
    metrics = steps.train_step(run, 0, data.group(run, 0, [1.0, 0.0], seed=1))
    name = metrics["adapter"]
    assert name.startswith(f"run-{run}@") and metrics["engine_sync"] == {lora_server.url: "ok"}, metrics["engine_sync"]
    assert name in served_adapters(lora_server.client)
    with session_scope() as s:
        checkpoint = s.scalar(TrainingStep.__table__.select().with_only_columns(TrainingStep.checkpoint_path)
                              .where(TrainingStep.run_id == run))
    trained = PeftModel.from_pretrained(copy.deepcopy(base_model), f"{checkpoint}/adapter").merge_and_unload().eval()
    out = greedy(lora_server.client, name)
    assert logprob_gap(trained, out) < 1e-3 and logprob_gap(base_model, out) > 1e-4  # the step moved it

    assert engine_resync.resync_engines() == {}  # vLLM serves it: nothing to do
    assert unload_adapter(lora_server.client, name)  # as after a restart
    assert engine_resync.resync_engines() == {lora_server.url: "ok"} and name in served_adapters(lora_server.client)
