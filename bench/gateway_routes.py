"""What recording routed experts costs the gateway per completion, side by side with the logprobs.

An MoE engine's answer carries ``routed_experts`` as a JSON list ``[tokens][layers][top_k]``;
the gateway parses it with the rest of the answer (orjson, ``app.engines.stream.loads_json``),
turns it into int16 (``app.engines.route_bytes.routes_from_answer``) and stores
``to_bytes`` of it.  Printed per model shape and completion length: the JSON bytes per token on
the wire, the stored bytes per token, and the gateway's CPU time for the routes (parse + int16 +
bytes) next to the same for the answer's logprobs list, which every completion already pays.

    .venv/bin/python bench/gateway_routes.py [--tokens 1024 8192] [--repeat 5]

Routes are random ids (their values do not change the cost).  Shapes: the tiny MoE (2 layers,
top-2), tiny-moe-wide (2, top-4), Qwen3-30B-A3B (48 layers, top-8).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from app.engines.route_bytes import routes_from_answer, to_bytes
from app.engines.stream import loads_json

SHAPES = {"tiny-moe": (2, 2, 8), "tiny-moe-wide": (2, 4, 32), "qwen3-30b-a3b": (48, 8, 128)}


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000.0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'shape':<15}{'tokens':>8}{'JSON B/tok':>12}{'stored B/tok':>14}{'routes ms':>11}"
          f"{'logprobs ms':>13}{'ratio':>8}")
    for name, (layers, top_k, experts) in SHAPES.items():
        for n in args.tokens:
            routes = rng.integers(0, experts, size=(n, layers, top_k)).tolist()
            wire = json.dumps({"routed_experts": routes})
            logprobs = json.dumps({"content": [{"token": "x", "logprob": float(v), "bytes": [120]}
                                               for v in -rng.random(n)]})
            routes_ms = median_ms(lambda: to_bytes(routes_from_answer(loads_json(wire)["routed_experts"])),
                                  args.repeat)
            logprobs_ms = median_ms(lambda: [e["logprob"] for e in loads_json(logprobs)["content"]], args.repeat)
            stored = len(to_bytes(routes_from_answer(routes)))
            print(f"{name:<15}{n:>8}{len(wire) / n:>12.1f}{stored / n:>14.0f}{routes_ms:>11.2f}"
                  f"{logprobs_ms:>13.2f}{routes_ms / logprobs_ms:>8.2f}")


if __name__ == "__main__":
    main()
