"""Several LoRA runs on one deployment: adapter swap time in the trainer and the engine, and the
embedded engine's throughput with 4 adapters in its batches against the base model's.

    .venv/bin/python bench/tenants.py [--model smollm2] [--rank 16] [--tenants 4] [--swaps 40]
                                      [--requests 8] [--tokens 48] [--threads 1]

Trainer: one LoRA `Trainer` (rank `--rank`, alpha 2 x rank, every attention and MLP projection)
wrapped in a `TenantPool`; each of `--tenants` runs takes one update (so it has AdamW moments and
a step counter), then the active run is switched round-robin `--swaps` times and each
`TenantPool.activate` (park the active run's adapter + AdamW state, install the next) is timed.
Engine: the adapter file each tenant's trainer state would produce is loaded into the engine's
`AdapterSet` (timed: read, hash check, tensors), then `--requests` greedy requests of `--tokens`
tokens (one prompt each, ~60 tokens) are decoded together by the `BatchScheduler` twice: all on
the base model, and spread over the 4 adapters (mixed batches); tokens/s of each and their ratio.
Prints one JSON object; fp32 on CPU, `--threads` torch threads.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402


def sequences(seed: int, vocab: int, n: int = 2, length: int = 48):
    import random

    from app.training.batching import StepSequence

    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        out.append(StepSequence(ids, mask, [-5.0 if m else 0.0 for m in mask], 1.0 if i % 2 == 0 else -1.0, i))
    return out


def trainer_swaps(args) -> tuple[dict, list]:
    from app.engines.embedded.adapters import peft_weights
    from app.runconfig import TrainingConfig
    from app.training.policy import load_policy
    from app.training.tenants import TenantPool
    from app.training.trainer import Trainer

    model, vocab = load_policy(args.model, torch.device("cpu"))
    configs = [TrainingConfig(lora=True, lora_r=args.rank, lora_alpha=2 * args.rank, learning_rate=1e-4, seed=s)
               for s in range(args.tenants)]
    pool = TenantPool(Trainer(configs[0], model), args.model)
    step_s = []
    adapters = []
    for run, cfg in enumerate(configs):
        pool.activate(run, cfg)
        started = time.perf_counter()
        pool.trainer.update(sequences(run, vocab))
        step_s.append(time.perf_counter() - started)
        state = {k: v.detach().clone() for k, v in pool.trainer.model.state_dict().items() if "lora_" in k}
        adapters.append(peft_weights(state))
    times = []
    for i in range(args.swaps):
        run = i % args.tenants
        pool.activate(run, configs[run])
        times.append(pool.last_swap_s)
    adapter_bytes = sum(p.numel() * p.element_size() for p in pool.params.values())
    moments = sum(v.numel() * v.element_size() for s in pool.trainer.optimizer.state.values()
                  for v in s.values() if torch.is_tensor(v))
    return {
        "adapter_parameters": sum(p.numel() for p in pool.params.values()),
        "adapter_mib": adapter_bytes / 2**20,
        "adamw_state_mib": moments / 2**20,
        "swap_ms_median": 1000 * statistics.median(times),
        "swap_ms_max": 1000 * max(times),
        "swaps": len(times),
        "train_step_s_median": statistics.median(step_s),
    }, adapters


def engine_throughput(args, adapters: list) -> dict:
    from app.engines.embedded.adapters import save_adapter
    from app.engines.lora_format import adapter_name
    from app.engines.embedded.batching import BatchScheduler
    from app.engines.embedded.events import GenerationRequest, TokenEvent
    from app.engines.embedded.sampling import SamplingParams
    from app.engines.modeling import load_model

    model, _tok = load_model(args.model)
    scheduler = BatchScheduler(model, max_batch=args.requests, prefix_cache_tokens=0).start()
    loaded, load_ms = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, weights in enumerate(adapters[:4]):
            folder = os.path.join(tmp, f"run-{i}")
            save_adapter(folder, weights, args.rank, 2 * args.rank, 1)
            started = time.perf_counter()
            loaded.append(scheduler.adapters.load(adapter_name(f"run-{i}", folder), folder))
            load_ms.append(1000 * (time.perf_counter() - started))

    def decode(assign) -> float:
        requests = []
        started = time.perf_counter()
        for i in range(args.requests):
            prompt = [(17 * i + 31 * j) % 40000 + 5 for j in range(60)]
            requests.append(scheduler.submit(GenerationRequest(prompt, args.tokens, SamplingParams(temperature=0.0),
                                                               adapter=assign(i))))
        tokens = 0
        for request in requests:
            while True:
                event = request.events.get(timeout=600)
                if isinstance(event, TokenEvent):
                    tokens += 1
                    if event.finish_reason:
                        break
        return tokens / (time.perf_counter() - started)

    try:
        decode(lambda i: None)  # warm-up
        base, mixed = [], []
        for _ in range(2):  # alternate, so load on the shared box hits both alike
            base.append(decode(lambda i: None))
            mixed.append(decode(lambda i: loaded[i % len(loaded)]))
    finally:
        scheduler.stop()
    return {"adapter_load_ms_median": statistics.median(load_ms), "base_tokens_per_s": max(base),
            "four_adapters_tokens_per_s": max(mixed), "ratio_four_adapters_to_base": max(mixed) / max(base),
            "requests": args.requests, "tokens_per_request": args.tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--swaps", type=int, default=40)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    trainer, adapters = trainer_swaps(args)
    engine = engine_throughput(args, adapters)
    print(json.dumps({"model": args.model, "rank": args.rank, "threads": args.threads,
                      "trainer": trainer, "engine": engine}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
