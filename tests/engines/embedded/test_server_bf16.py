"""The embedded engine serving bfloat16 (``--dtype`` / ``TURNSTILE_ENGINE_DTYPE``), real server.

A bf16 engine and the fp32 trainer compute different functions, so an MoE's routers can pick
other experts for a token: what routing replay corrects.  Over real HTTP, requests decoded in one
batch: the model card says bfloat16; the engine's routes replayed in the trainer's fp32 forward
(``app.engines.routing.score_completion``) are run exactly, and the |logprob gap| is below the
replay-off one.  A full-weight load of an fp32 checkpoint (the trainer's, Hub expert layout) is
cast into bf16: the server's logprobs then follow a bf16 copy of the new weights; an fp32 LoRA
adapter is held in bf16.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

from app.engines.embedded.adapters import AdapterSet, peft_weights, rows, save_adapter
from app.engines.lora_format import adapter_name
from app.engines.modeling import build_tiny_model, load_model, save_weights
from app.engines.routing import score_completion
from app.training import policy

from support.engine_process import EngineProcess, draw_routed

PROMPTS = ["def add(a, b):", "The capital of France is", "SELECT * FROM", "class Stack:",
           "import numpy as np", "Once upon a time"]
TOKENS = 48  # enough (token, layer) pairs that some routes differ off replay: 1.6% at 48 in the bench


def _draw(proc: EngineProcess) -> list[dict]:
    return draw_routed(proc, PROMPTS, TOKENS)


def _served(spec: str) -> tuple[dict, list[dict]]:
    """Model card and draws of a bf16 engine serving ``spec``."""
    load_model(spec)  # an MoE folder exists before the subprocess reads it
    proc = EngineProcess(spec, "--dtype", "bfloat16")
    try:
        return proc.client.models()[0], _draw(proc)
    finally:
        proc.stop()


def _score(model, drawn: list[dict], replay: bool) -> tuple[float, float]:
    """(mean |trainer - engine| logprob, share of (completion token, layer) routes that differ)."""
    gaps, differ = [], []
    with torch.no_grad():
        for s in drawn:
            logp, seen = score_completion(model, s["ids"], s["p"], s["routes"] if replay else None)
            gaps.append(np.abs(logp.numpy() - s["logprobs"]))
            if seen is not None:
                p = s["p"]
                differ.append((np.sort(seen[p:], -1) != np.sort(s["routes"][p:], -1)).any(-1).ravel())
    return float(np.concatenate(gaps).mean()), float(np.concatenate(differ).mean()) if differ else 0.0


@pytest.fixture(scope="module")
def dense_gap() -> float:
    card, drawn = _served("tiny")
    assert card["dtype"] == "bfloat16" and card["route_shape"] is None
    return _score(load_model("tiny")[0], drawn, replay=False)[0]


@pytest.mark.parametrize("spec", ["tiny-moe", "tiny-moe-wide"])
def test_bf16_engine_routes_replayed_in_fp32_trainer(spec, dense_gap):
    card, drawn = _served(spec)
    assert card["dtype"] == "bfloat16"
    trainer = load_model(spec)[0]  # fp32, as the trainer scores
    gap_off, differ_off = _score(trainer, drawn, replay=False)
    gap_on, differ_on = _score(trainer, drawn, replay=True)
    print(f"{spec} bf16 engine: routes differ {differ_off:.4f} -> {differ_on:.4f}, "
          f"|gap| {gap_off:.3e} -> {gap_on:.3e} (dense bf16 floor {dense_gap:.3e})")
    assert differ_on == 0.0
    # Some tokens' experts differ between bf16 engine and fp32 trainer (else replay changes nothing
    # and the next check is vacuous); replaying them lowers the gap towards the bf16 floor.
    assert differ_off > 0.0
    assert gap_on < gap_off
    assert gap_on < 3 * dense_gap  # bf16 vs fp32 rounding, not a wrong expert (those move ~1e-1)


def test_full_weight_reload_into_bf16_engine(tmp_path, monkeypatch):
    load_model("tiny-moe")
    monkeypatch.setenv("TURNSTILE_ENGINE_DTYPE", "bfloat16")  # the setting, not the flag
    proc = EngineProcess("tiny-moe")
    try:
        assert proc.client.models()[0]["dtype"] == "bfloat16"
        new = load_model("tiny-moe")[0]  # the trainer's fp32 weights after a step: seed-0 + noise
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(7)
            for param in new.parameters():
                param.add_(torch.randn_like(param) * 0.05)
        save_weights(new, tmp_path / "step-1", {"policy_version": 1})  # Hub layout: experts one by one
        assert proc.client.reload(str(tmp_path / "step-1"), 1) == 1
        drawn = _draw(proc)
        assert proc.client.models()[0]["dtype"] == "bfloat16"
    finally:
        proc.stop()
    as_served = new.to(torch.bfloat16)
    bf16_gap = _score(as_served, drawn, replay=True)[0]
    old_gap = _score(load_model("tiny-moe")[0].to(torch.bfloat16), drawn, replay=True)[0]  # old weights
    print(f"after reload: |gap| to bf16 new weights {bf16_gap:.3e}, to bf16 old weights {old_gap:.3e}")
    assert bf16_gap < 0.02  # the served function is the new weights rounded to bf16
    assert old_gap > 10 * bf16_gap  # the perturbation is visible, so the check above means something


def test_an_fp32_lora_adapter_is_cast_into_a_bf16_engine(tmp_path):
    """In process (the adapter set the server's scheduler holds): a trainer's fp32 LoRA on a bf16
    model is held in bf16 and adds its low-rank update to within bf16 rounding."""
    peft_model = policy.add_lora(build_tiny_model(0), 4, 8, 0.0)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)  # nonzero B, as after training
    save_adapter(tmp_path / "a", peft_weights({k: v for k, v in peft_model.state_dict().items() if "lora_" in k}),
                 4, 8, 1)
    reference = peft_model.merge_and_unload().eval()  # fp32
    served = build_tiny_model(0).to(torch.bfloat16)
    adapter = AdapterSet(served).load(adapter_name("run-1", tmp_path / "a"), tmp_path / "a")
    assert {t.dtype for ab in adapter.weights.values() for t in ab} == {torch.bfloat16}
    ids = torch.tensor([[5, 17, 300, 42, 7, 99, 1000, 23, 8, 64, 12, 77]])
    with torch.no_grad():
        base = torch.log_softmax(served(ids).logits.float(), -1)
        with rows([adapter], torch.device("cpu")):
            adapted = torch.log_softmax(served(ids).logits.float(), -1)
        expected = torch.log_softmax(reference(ids).logits, -1)
    err, moved = (adapted - expected).abs().mean().item(), (base - expected).abs().mean().item()
    print(f"bf16 engine + adapter vs fp32 merged reference: {err:.3e} (base model: {moved:.3e})")
    assert adapted.dtype == torch.float32
    assert err < 0.1 * moved  # the update is applied; what is left is bf16 rounding
