"""Routing replay against a real engine server: sample there, score in the trainer's fp32 forward.

Used by ``bench/moe_replay.py --engine embedded [--engine-dtype bfloat16]``.  Per model, the
embedded engine's server (``python -m app.engines.embedded.server``, fp32 or ``--dtype bfloat16``) samples ``samples`` completions at once
(batched decode, as under load) with ``logprobs``, ``return_token_ids`` and
``return_routed_experts``; the trainer side loads the same weights in fp32 and runs
``app.engines.routing.score_completion`` + backward of ``-sum(logprob)`` with replay off and on.

There is no vLLM arm: vLLM 0.32's CPU build serves neither the tiny models (its CPU attention
takes head sizes 32..512, ``vllm/v1/attention/backends/cpu_attn.py`` ``get_supported_head_sizes``;
the tiny models' heads are 16 wide) nor routes (``--enable-return-routed-experts`` needs Model
Runner V2, which needs a Triton CPU backend PyPI does not ship); docs/moe.md.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from app.config import ROOT
from app.engines.client import EngineClient
from app.engines.modeling import TINY_MOE_SHAPES, ensure_tiny_moe_folder, load_model
from app.engines.routing import route_shape, score_completion

PROMPTS = ["def add(a, b):", "The capital of France is", "import numpy as np", "Once upon a time",
           "SELECT * FROM", "for i in range(10):", "Q: what is 2+2? A:", "class Stack:"]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(spec: str, timeout_s: float = 300.0, dtype: str = "float32") -> Iterator[EngineClient]:
    """Start the embedded engine's server on ``spec`` (one torch thread, parameters in ``dtype``);
    yield a client; stop it.  Raises RuntimeError when it does not start or serves another dtype."""
    tmp = Path(tempfile.mkdtemp(prefix="moe-replay-"))
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "app.engines.embedded.server", "--model", spec, "--port", str(port),
            "--threads", "1", "--dtype", dtype]
    log = open(tmp / "server.log", "w+")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    client = EngineClient(f"http://127.0.0.1:{port}", timeout=600)
    try:
        try:
            client.health(wait_s=timeout_s)
        except TimeoutError:
            log.seek(0)
            raise RuntimeError(f"the engine did not start:\n{log.read()[-3000:]}")
        served = client.models()[0].get("dtype")
        if served != dtype:
            raise RuntimeError(f"the engine serves {served}, not {dtype}")
        yield client
    finally:
        client.close()
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(10)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)


def sample(client: EngineClient, samples: int, tokens: int) -> list[dict]:
    """``samples`` completions at once; each ``{"ids", "prompt_len", "logprobs", "routes"}``
    (``routes`` int16 ``[prompt + completion - 1, layers, top_k]`` or ``None``)."""
    def one(i: int) -> dict:
        out = client.chat([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=tokens, seed=i,
                          ignore_eos=True, logprobs=True, return_token_ids=True, return_routed_experts=True)
        choice = out["choices"][0]
        routes = out.get("routed_experts")
        return {"ids": out["prompt_token_ids"] + choice["token_ids"], "prompt_len": len(out["prompt_token_ids"]),
                "logprobs": np.array([c["logprob"] for c in choice["logprobs"]["content"]]),
                "routes": None if routes is None else np.array(routes, dtype=np.int16)}

    with ThreadPoolExecutor(samples) as pool:
        return list(pool.map(one, range(samples)))


def differ_share(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per layer: share of tokens whose top-k expert *sets* differ (order inside top-k ignored)."""
    return (np.sort(a, axis=-1) != np.sort(b, axis=-1)).any(axis=-1).mean(axis=0)


def measure(spec: str, samples: int, tokens: int, dtype: str = "float32") -> dict:
    """``{"off"|"on": {"diff": per-layer share | None, "gap": mean |logprob gap|, "ms": median step}}``
    (``on`` only when the engine returned routes); the server serves ``dtype``, the trainer fp32."""
    if spec in TINY_MOE_SHAPES:
        ensure_tiny_moe_folder(spec)  # written once, before the server reads it
    with serve(spec, dtype=dtype) as client:
        drawn = sample(client, samples, tokens)
    trainer = load_model(spec)[0].train()
    moe = route_shape(trainer) is not None
    rows: dict[str, dict[str, list]] = {}
    for s in drawn:
        modes = ["off"] + (["on"] if moe and s["routes"] is not None else [])
        for mode in modes:
            trainer.zero_grad()
            start = time.perf_counter()
            logp, seen = score_completion(trainer, s["ids"], s["prompt_len"], s["routes"] if mode == "on" else None)
            (-logp.sum()).backward()
            row = rows.setdefault(mode, {"diff": [], "gap": [], "time": []})
            row["time"].append(time.perf_counter() - start)
            row["gap"].append(np.abs(logp.detach().numpy() - s["logprobs"]).mean())
            if moe and s["routes"] is not None:
                p = s["prompt_len"]
                row["diff"].append(differ_share(s["routes"][p:], seen[p:]))
    return {mode: {"diff": np.mean(r["diff"], axis=0) if r["diff"] else None, "gap": float(np.mean(r["gap"])),
                   "ms": 1000 * statistics.median(r["time"])} for mode, r in rows.items()}

