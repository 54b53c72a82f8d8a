"""Replay parity on the embedded engine's real server: the trainer replays the engine's routes.

Samples from the tiny MoE (and the dense tiny model, the floor) over real HTTP, batched (all
requests at once), then scores prompt + completion in the trainer's fp32 forward with
``app.engines.routing.score_completion``: with the engine's routes forced the forward runs exactly
those experts, and the |logprob gap| to the engine's own logprobs is at the dense model's level.
"""
from __future__ import annotations


import numpy as np
import pytest

from app.engines.modeling import load_model
from app.engines.routing import route_shape, score_completion

from support.engine_process import EngineProcess, draw_routed

PROMPTS = ["def add(a, b):", "The capital of France is", "SELECT * FROM", "class Stack:"]


def _draw(spec: str, tokens: int = 12) -> list[dict]:
    load_model(spec)  # an MoE folder exists before the subprocess reads it
    proc = EngineProcess(spec)
    try:
        assert proc.client.models()[0]["dtype"] == "float32"  # the default: the trainer's numerics
        return draw_routed(proc, PROMPTS, tokens)
    finally:
        proc.stop()


def _gap(spec: str, drawn: list[dict], replay: bool) -> tuple[float, list]:
    """Mean |trainer - engine| logprob over all sampled tokens, and (engine, trainer) routes pairs."""
    model = load_model(spec)[0]
    gaps, pairs = [], []
    for s in drawn:
        logp, seen = score_completion(model, s["ids"], s["p"], s["routes"] if replay else None)
        gaps.append(np.abs(logp.detach().numpy() - s["logprobs"]))
        pairs.append((s["routes"], seen))
    return float(np.concatenate(gaps).mean()), pairs


@pytest.fixture(scope="module")
def dense_gap() -> float:
    return _gap("tiny", _draw("tiny"), replay=False)[0]


@pytest.mark.parametrize("spec", ["tiny-moe", "tiny-moe-wide"])
def test_replayed_routes_and_gap_at_dense_level(spec, dense_gap):
    drawn = _draw(spec)
    shape = route_shape(load_model(spec)[0])
    for s in drawn:   # routes of the prompt and every sampled token but the last
        assert s["routes"].shape == (len(s["ids"]) - 1, shape[0], shape[1])
    gap_on, pairs = _gap(spec, drawn, replay=True)
    for engine_routes, trainer_routes in pairs:
        assert np.array_equal(engine_routes, trainer_routes)
    gap_off, _ = _gap(spec, drawn, replay=False)
    # fp32 engine and fp32 trainer: the gap is float noise (measured ~2.5e-7 MoE, ~3.6e-7 dense,
    # bench/moe_replay.py --engine embedded); a replay that forced the wrong tokens' experts
    # would move logprobs by ~1e-2 (the bf16 table in docs/moe.md).
    assert gap_on <= 4 * dense_gap + 1e-6, (gap_on, dense_gap)
    assert gap_on <= gap_off + 1e-6
    # The check can fail: the same routes one token late are another function.
    late = [dict(s, routes=np.roll(s["routes"], 1, axis=0)) for s in drawn]
    assert _gap(spec, late, replay=True)[0] > 100 * dense_gap
