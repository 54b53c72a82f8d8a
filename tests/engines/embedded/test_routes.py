"""The embedded engine's scheduler returns the routed experts it ran (tiny Qwen3-MoE, in process).

Each request's routes are checked against a fresh full forward of prompt + completion recorded
with ``record_routes``: same experts per token and layer, for prompt and sampled tokens, in a
batch of concurrent rows and after a prefix-cache hit (the cached tokens' routes come from the
cache, the rest from the run).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from app.engines.embedded.batching import BatchScheduler
from app.engines.embedded.events import GenerationRequest, TokenEvent
from app.engines.embedded.routes import routes_of
from app.engines.embedded.sampling import SamplingParams
from app.engines.modeling import build_tiny_model, load_model
from app.engines.routing import check_routes, record_routes, route_shape, stack_routes

PROMPT = [1, 17, 42, 99, 7, 300, 12, 5, 77, 8, 1000, 31, 64, 2048, 9, 11, 13, 4]


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-moe")[0]


def run(sched: BatchScheduler, prompts: list[list[int]], max_tokens: int = 12) -> list[tuple[list[int], np.ndarray]]:
    requests = [sched.submit(GenerationRequest(list(p), max_tokens, SamplingParams(temperature=1.0, seed=i)))
                for i, p in enumerate(prompts)]
    out = []
    for p, request in zip(prompts, requests):
        ids = []
        while True:
            event = request.events.get(timeout=300)
            if isinstance(event, TokenEvent):
                ids.append(event.sample.token_id)
                if event.finish_reason is not None:
                    routes = None if event.routes is None else routes_of(event.routes, len(p) + len(ids) - 1)
                    out.append((ids, routes))
                    break
    return out


def reference(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad(), record_routes(model) as calls:
        model(torch.tensor([tokens]))
    return stack_routes(calls)


def agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float((np.sort(a, -1) == np.sort(b, -1)).all(-1).mean())


def test_routes_cover_prompt_and_sampled_tokens_in_a_batch(model):
    sched = BatchScheduler(model, max_batch=4, prefill_chunk=8, prefix_cache_tokens=0).start()
    try:
        prompts = [PROMPT, PROMPT[:9], PROMPT[3:] + [55, 66]]
        for prompt, (ids, routes) in zip(prompts, run(sched, prompts)):
            tokens = prompt + ids
            # The last sampled token never ran through the model.
            check_routes(routes, len(tokens) - 1, route_shape(model), "engine")
            # Left-padded batched decode in fp32 versus one full forward: the same experts
            # except where two router probabilities tie to rounding.
            assert agreement(routes, reference(model, tokens[:-1])) >= 0.99
    finally:
        sched.stop()


def test_prefix_cache_hit_supplies_the_cached_tokens_routes(model):
    sched = BatchScheduler(model, max_batch=2, prefill_chunk=64, prefix_cache_tokens=4096).start()
    try:
        (ids, first), = run(sched, [PROMPT])
        follow_up = PROMPT + ids + [40, 41, 42]
        (more, routes), = run(sched, [follow_up])
        assert sched.stats["prefix_hit_tokens"] > 0
        tokens = follow_up + more
        check_routes(routes, len(tokens) - 1, route_shape(model), "engine")
        hit = sched.stats["prefix_hit_tokens"]
        assert np.array_equal(routes[:hit], first[:hit])  # from the cache, not recomputed nor empty
        assert agreement(routes, reference(model, tokens[:-1])) >= 0.99
    finally:
        sched.stop()


def test_dense_model_returns_no_routes():
    sched = BatchScheduler(build_tiny_model(0), max_batch=2, prefix_cache_tokens=0).start()
    try:
        (_ids, routes), = run(sched, [PROMPT], max_tokens=3)
        assert routes is None
    finally:
        sched.stop()
