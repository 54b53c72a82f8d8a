"""Weight reload on a real engine subprocess: new version, exact new logprobs, nothing failed."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from app.engines.client import EngineClient, EngineHTTPError
from app.engines.modeling import build_tiny_model, save_weights

MESSAGES = [{"role": "user", "content": "Count to ten."}]


def recompute(model, prompt_ids, token_ids):
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt_ids) - 1:-1].gather(1, torch.tensor(token_ids)[:, None])[:, 0]


def perturbed_checkpoint(directory, seed: int, version: int):
    """Tiny model whose weights differ from the served seed-0 model (seed-0 weights + noise)."""
    model = build_tiny_model(0)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    save_weights(model, directory, {"policy_version": version})
    return model


def chat_fields(**extra):
    return dict(max_tokens=16, seed=3, logprobs=True, return_token_ids=True, ignore_eos=True, **extra)


def test_reload_bumps_version_and_logprobs_follow_new_weights(engine, tmp_path):
    before = engine.client.chat(MESSAGES, **chat_fields())
    new_model = perturbed_checkpoint(tmp_path / "step-1", seed=11, version=1)
    assert engine.client.reload(str(tmp_path / "step-1"), 1) == 1
    after = engine.client.chat(MESSAGES, **chat_fields())
    assert before["policy_version"] == 0 and after["policy_version"] == 1
    assert after["system_fingerprint"].endswith(":v1")
    choice = after["choices"][0]
    new_diff = (recompute(new_model, after["prompt_token_ids"], choice["token_ids"])
                - torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])).abs().max().item()
    old_diff = (recompute(build_tiny_model(0), after["prompt_token_ids"], choice["token_ids"])
                - torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]])).abs().max().item()
    print(f"after reload: max abs diff vs new weights {new_diff:.2e}, vs old weights {old_diff:.2e}")
    assert new_diff < 1e-4
    assert old_diff > 1e-2  # the perturbation is visible, so the check above is meaningful


def test_bad_checkpoint_is_rejected_and_version_kept(engine, tmp_path):
    version = engine.client.policy_version()
    with pytest.raises(EngineHTTPError) as err:
        engine.client.reload(str(tmp_path / "missing"), version + 1)
    assert err.value.status == 400
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(EngineHTTPError) as err:
        engine.client.reload(str(wrong), version + 1)
    assert err.value.status == 400
    assert engine.client.policy_version() == version
    assert engine.client.chat(MESSAGES, max_tokens=2)["policy_version"] == version


def test_requests_in_flight_and_arriving_during_reload_are_answered(engine, tmp_path):
    """Mode `wait`: a long stream running when the reload starts finishes on the old version; a
    request sent while the reload waits is held and answered with the new version; neither fails."""
    start_version = engine.client.policy_version()
    target = start_version + 1
    perturbed_checkpoint(tmp_path / "ckpt", seed=23, version=target)
    # A long client timeout: on a loaded shared CPU the held calls wait for the whole stream.
    slow = EngineClient(engine.url, timeout=900)
    stream = slow.chat(MESSAGES, stream=True, max_tokens=600, ignore_eos=True, return_token_ids=True)
    first = next(stream)
    assert first["policy_version"] == start_version

    reload_result: dict = {}
    reloader = threading.Thread(target=lambda: reload_result.setdefault(
        "version", slow.reload(str(tmp_path / "ckpt"), target, mode="wait")))
    reloader.start()
    deadline = time.monotonic() + 30
    while True:
        health = engine.client.health()
        if health["reload_pending"]:
            break
        assert time.monotonic() < deadline, "reload never became pending"
        time.sleep(0.01)
    assert health["running"] + health["prefilling"] >= 1, "the long request ended before the reload began"

    held: dict = {}
    arriving = threading.Thread(target=lambda: held.setdefault("out", slow.chat(MESSAGES, max_tokens=4)))
    arriving.start()
    deadline = time.monotonic() + 20
    while engine.client.health()["waiting"] < 1 and reloader.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert reloader.is_alive(), "the reload finished before the second request arrived: nothing was held"

    chunks = [first, *stream]
    arriving.join(900)
    reloader.join(900)
    slow.close()
    assert {c["policy_version"] for c in chunks} == {start_version}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(ch.get("token_ids", [])) for c in chunks for ch in c["choices"]) == 600
    assert reload_result["version"] == target
    assert held["out"]["policy_version"] == target
    assert held["out"]["choices"][0]["finish_reason"] in ("length", "stop")


def test_loading_weights_needs_the_api_token(engine, tmp_path):
    """The admin route refuses a caller without the deployment's token (401, vLLM's error body);
    nothing is loaded and the served version stays."""
    import httpx

    version = engine.client.policy_version()
    perturbed_checkpoint(tmp_path / "step-x", seed=5, version=777)
    body = {"path": str(tmp_path / "step-x"), "policy_version": 777}
    for headers in ({}, {"Authorization": "Bearer wrong-token"}, {"Authorization": "Basic x"}):
        resp = httpx.post(f"{engine.url}/v1/load_weights", json=body, headers=headers, timeout=30)
        assert resp.status_code == 401 and resp.json()["error"]["type"] == "AuthenticationError"
    with pytest.raises(EngineHTTPError) as err:
        EngineClient(engine.url, admin_token="wrong-token").reset_to_base()
    assert err.value.status == 401
    assert engine.client.policy_version() == version


def test_the_engine_names_the_weights_it_serves(engine, tmp_path):
    """`GET /v1/policy_version` reports `weights`: the start spec's name, a loaded folder's real path
    (a symlink is named by its target), or the name the caller gave; a bad name is refused in vLLM's
    error body and what is served stays as it was."""
    assert engine.client.reset_to_base() == 0
    assert engine.client.serving() == (0, "tiny")
    folder = tmp_path / "ckpt"
    perturbed_checkpoint(folder, seed=5, version=1)
    (tmp_path / "link").symlink_to(folder)
    assert engine.client.reload(str(tmp_path / "link"), 1) == 1
    assert engine.client.serving() == (1, str(folder.resolve()))
    assert engine.client.reload(str(folder), 2, weights="run:7 start") == 2
    assert engine.client.serving() == (2, "run:7 start")
    for bad in ("", "x" * 4097, 42):
        with pytest.raises(EngineHTTPError) as err:
            engine.client.request("POST", "/v1/load_weights", {"path": str(folder), "policy_version": 3, "weights": bad},
                                  headers=engine.client._admin_headers())
        assert err.value.status == 400 and err.value.body["error"]["param"] == "weights"
    assert engine.client.serving() == (2, "run:7 start")
    assert engine.client.reset_to_base() == 0
    assert engine.client.serving() == (0, "tiny")
