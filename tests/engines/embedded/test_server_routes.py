"""The engine serves the tiny Qwen3-MoE over real HTTP and returns the routed experts it ran."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from app.engines.modeling import load_model
from app.engines.routing import check_routes, record_routes, route_shape, stack_routes

from support.engine_process import EngineProcess

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def moe_engine():
    load_model("tiny-moe")  # the folder exists before the subprocess reads it
    proc = EngineProcess("tiny-moe")
    try:
        yield proc
    finally:
        proc.stop()


def _reference(tokens: list[int]) -> np.ndarray:
    model = load_model("tiny-moe")[0]
    with torch.no_grad(), record_routes(model) as calls:
        model(torch.tensor([tokens]))
    return stack_routes(calls)


@pytest.mark.parametrize("stream", [False, True])
def test_routed_experts_of_prompt_and_sampled_tokens(moe_engine, stream):
    fields = dict(max_tokens=10, seed=3, ignore_eos=True, return_token_ids=True, return_routed_experts=True)
    if stream:
        chunks = list(moe_engine.client.chat(MESSAGES, stream=True, **fields))
        prompt_ids = chunks[0]["prompt_token_ids"]
        token_ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]
        routed = [c["routed_experts"] for c in chunks if "routed_experts" in c]
        assert len(routed) == 1
        routes = np.array(routed[0], dtype=np.int16)
    else:
        out = moe_engine.client.chat(MESSAGES, **fields)
        prompt_ids, token_ids = out["prompt_token_ids"], out["choices"][0]["token_ids"]
        routes = np.array(out["routed_experts"], dtype=np.int16)
    tokens = prompt_ids + token_ids
    model = load_model("tiny-moe")[0]
    check_routes(routes, len(tokens) - 1, route_shape(model), "engine")  # the last token never ran
    same = (np.sort(routes, -1) == np.sort(_reference(tokens[:-1]), -1)).all(-1).mean()
    assert same >= 0.99


def test_no_routed_experts_unless_asked(moe_engine):
    out = moe_engine.client.chat(MESSAGES, max_tokens=2, seed=1)
    assert "routed_experts" not in out
