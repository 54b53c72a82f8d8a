"""Routing replay on CPU, side by side with replay off: route disagreement, logprob gap, step time.

The "rollout" side samples each completion token by token with a KV cache in bf16 (the
precision an inference engine serves in), recording the routers' expert ids and the sampled
tokens' logprobs.  The "trainer" side scores prompt + completion in one fp32 forward, as the
GRPO step does, with replay off (its own routing) and on (the recorded routes forced,
``app.engines.routing.RouteReplay``), then runs the backward of ``-sum(logprob)``.

This is a model of the engine (transformers' own forward with a KV cache, not the embedded
engine's server nor vLLM): it measures what replay changes once the routes are captured.

    .venv/bin/python bench/moe_replay.py [--models tiny-moe tiny-moe-wide tiny] [--samples 8] [--tokens 48]
    .venv/bin/python bench/moe_replay.py --engine embedded   # sample from the embedded engine's server
    .venv/bin/python bench/moe_replay.py --engine embedded --engine-dtype bfloat16   # ... serving bf16
    .venv/bin/python bench/moe_replay.py --shape qwen3-30b-a3b --layers 16 [...]   # GPU: memory and step time

``--engine embedded`` samples from the embedded engine's real server instead
(``bench/moe_replay_engine.py``: all samples decoded in one batch; fp32 by default,
``--engine-dtype bfloat16`` serves bf16 while the trainer stays fp32), whose routes the trainer replays; vLLM's CPU build can serve neither the tiny models nor routes (docs/moe.md).
``--shape`` runs ``bench/moe_replay_shape.py`` (its flags follow) on a real model's shape.

Printed per model: share of completion tokens whose expert set differs between rollout and
trainer for each MoE layer, mean |trainer - rollout| logprob over sampled tokens, and the
median step time (forward + backward, ms).  The dense ``tiny`` model gives the gap's floor.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import numpy as np
import torch

from app.engines.modeling import load_model
from app.engines.routing import RouteReplay, record_routes, route_shape, stack_routes

PROMPTS = ["def add(a, b):", "The capital of France is", "import numpy as np\n", "Once upon a time",
           "SELECT * FROM", "for i in range(10):", "Q: what is 2+2? A:", "class Stack:"]


def rollout(model, prompt_ids: torch.Tensor, tokens: int, gen: torch.Generator):
    """Sample ``tokens`` ids with a KV cache; return (ids [T], logprobs [T], routes [P+T, L, k] | None)."""
    sampled, logprobs = [], []
    with torch.no_grad(), record_routes(model) as calls:
        out = model(prompt_ids, use_cache=True)
        for _ in range(tokens):
            logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            token = torch.multinomial(logp.exp(), 1, generator=gen)
            sampled.append(int(token))
            logprobs.append(float(logp[token]))
            out = model(token.view(1, 1), past_key_values=out.past_key_values, use_cache=True)
    routes = stack_routes(calls) if calls else None
    return sampled, np.array(logprobs), routes


def trainer_step(model, ids: torch.Tensor, prompt_len: int, routes=None):
    """fp32 forward + backward of -sum(logprob of the completion); returns (logprobs, routes, seconds)."""
    model.zero_grad()
    start = time.perf_counter()
    with record_routes(model) as calls:
        if routes is not None:
            with RouteReplay(model) as replay:
                replay.set(routes)
                logits = model(ids).logits
        else:
            logits = model(ids).logits
    logp = torch.log_softmax(logits[0, prompt_len - 1:-1].float(), dim=-1)
    chosen = logp.gather(-1, ids[0, prompt_len:, None])[:, 0]
    (-chosen.sum()).backward()
    seconds = time.perf_counter() - start
    return chosen.detach().numpy(), (stack_routes(calls) if calls else None), seconds


def differ_share(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per layer: share of tokens whose top-k expert *sets* differ (order inside top-k ignored)."""
    return (np.sort(a, axis=-1) != np.sort(b, axis=-1)).any(axis=-1).mean(axis=0)


def measure(spec: str, samples: int, tokens: int) -> dict:
    trainer, tok = load_model(spec)
    engine = copy.deepcopy(trainer).to(torch.bfloat16).eval()
    trainer.train()
    moe = route_shape(trainer) is not None
    gen = torch.Generator().manual_seed(0)
    rows = {"off": {"diff": [], "gap": [], "time": []}, "on": {"diff": [], "gap": [], "time": []}}
    for i in range(samples):
        prompt = tok(PROMPTS[i % len(PROMPTS)], return_tensors="pt").input_ids
        sampled, engine_logp, engine_routes = rollout(engine, prompt, tokens, gen)
        ids = torch.cat([prompt, torch.tensor([sampled])], dim=1)
        p = prompt.shape[1]
        # Every sampled token was fed back through the engine once, so its routes cover ids exactly.
        for mode in ("off", "on") if moe else ("off",):
            forced = engine_routes if mode == "on" else None
            logp, routes, seconds = trainer_step(trainer, ids, p, forced)
            rows[mode]["gap"].append(np.abs(logp - engine_logp).mean())
            rows[mode]["time"].append(seconds)
            if moe:
                rows[mode]["diff"].append(differ_share(engine_routes[p:], routes[p:]))
    return {mode: {"diff": np.mean(r["diff"], axis=0) if r["diff"] else None,
                   "gap": float(np.mean(r["gap"])) if r["gap"] else None,
                   "ms": 1000 * statistics.median(r["time"]) if r["time"] else None} for mode, r in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny-moe", "tiny-moe-wide", "tiny"])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--engine", choices=["embedded"],
                        help="sample from this engine's server (default: transformers' own bf16 forward)")
    parser.add_argument("--engine-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="with --engine: the server's parameter dtype (the trainer is fp32 either way)")
    parser.add_argument("--shape", help="run bench/moe_replay_shape.py with the remaining flags")
    args, rest = parser.parse_known_args()
    if args.shape:
        from moe_replay_shape import main as shape_main  # beside this script

        shape_main(["--shape", args.shape, *rest])
        return
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.engine_dtype != "float32" and not args.engine:
        parser.error("--engine-dtype needs --engine (the default rollout is transformers' bf16 forward)")
    torch.set_num_threads(1)
    rollout = f"{args.engine} server, {args.engine_dtype}" if args.engine else "transformers bf16 KV cache"
    print(f"rollout: {rollout}; trainer: fp32 forward + backward")
    print(f"{'model':<15} {'replay':<6} {'routes differ per layer':<26} {'|logprob gap|':>14} {'step ms':>8}")
    for spec in args.models:
        if args.engine:
            from moe_replay_engine import measure as measure_engine  # beside this script

            result = measure_engine(spec, args.samples, args.tokens, args.engine_dtype)
        else:
            result = measure(spec, args.samples, args.tokens)
        for mode, r in result.items():
            if r["gap"] is None:
                continue
            if r["diff"] is not None:
                diff = " ".join(f"{x:.3f}" for x in r["diff"])
            else:
                diff = "dense" if spec == "tiny" else "no routes from engine"
            print(f"{spec:<15} {mode:<6} {diff:<26} {r['gap']:>14.3e} {r['ms']:>8.1f}")


if __name__ == "__main__":
    main()
