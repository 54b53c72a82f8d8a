"""The trainer's activation memory model (app/training/memory.py) against measured peaks.

    .venv/bin/python bench/memory_model.py [--device cpu|cuda] [--tokens 1024,4096] [--trainable 64]

For each chain length and each checkpointing scheme (none, every 2nd layer, full) it trains
one chain of the tiny model (forward + backward through the trainer's loss path) in a fresh
process and prints the predicted activation peak next to the measured one: on CPU the rise of
the resident set's high-water mark (VmHWM, reset through /proc/self/clear_refs) above the
memory held before the pass, with glibc's mmap threshold at 64 KiB so that freed tensors leave
the resident set; on CUDA `max_memory_allocated` above `memory_allocated`.  `--trainable`
sampled positions at the chain's end (few, so the LM head's chunk does not hide the body).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

SCHEMES = {"none": lambda layers: (), "every 2nd": lambda layers: tuple(range(0, layers, 2)),
           "full": lambda layers: tuple(range(layers))}


def _status(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(tokens: int, scheme: str, trainable: int, device: torch.device) -> dict:
    """Predicted and measured activation peak (bytes) of one chain; run in a fresh process."""
    import gc

    from app.engines.modeling import build_tiny_model
    from app.runconfig import TrainingConfig
    from app.training import head, memory, policy
    from app.training.batching import StepSequence, make_micro_batches
    from app.training.trainer import Trainer

    rng = random.Random(0)
    seq = StepSequence([rng.randrange(3, 49000) for _ in range(tokens)], [0] * (tokens - trainable) + [1] * trainable,
                       [0.0] * tokens, 1.0)
    trainer = Trainer(TrainingConfig(micro_batch_tokens=tokens, activation_checkpointing=False),
                      build_tiny_model(0).to(device))
    layers = SCHEMES[scheme](trainer.shape.layers)
    policy.set_checkpointed_layers(trainer.model, layers)
    (mb,) = make_micro_batches([seq], tokens, "token")
    mb = mb.to(device)
    trainer.forward_logprobs(mb, grad=True).sum().backward()  # gradient buffers exist from here on
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        before = _status("VmRSS")
    trainer.forward_logprobs(mb, grad=True).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = _status("VmHWM") - before
    predicted = memory.activation_bytes(trainer.shape, tokens, len(layers), act_bytes=2 if device.type == "cuda" else 4,
                                        resid_bytes=4, head_chunk=min(head.chunk_positions(trainer.shape.vocab), trainable))
    return {"tokens": tokens, "scheme": scheme, "predicted": predicted, "measured": peak}


def measure_fresh(tokens: int, scheme: str, trainable: int, device: str) -> dict:
    """`measure` in a fresh interpreter (so one measurement's allocator state cannot hide another's)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe", json.dumps([tokens, scheme, trainable]),
                          "--device", device], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--tokens", default="1024,4096", help="comma-separated chain lengths")
    parser.add_argument("--trainable", type=int, default=64)
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        tokens, scheme, trainable = json.loads(args.probe)
        print(json.dumps(measure(tokens, scheme, trainable, torch.device(args.device))))
        return
    print(f"{'tokens':>8} {'scheme':<10} {'predicted MiB':>14} {'measured MiB':>13} {'measured/predicted':>19}")
    for tokens in (int(n) for n in args.tokens.split(",") if n):
        for scheme in SCHEMES:
            r = measure_fresh(tokens, scheme, args.trainable, args.device)
            print(f"{tokens:>8} {scheme:<10} {r['predicted'] / 2**20:>14.1f} {r['measured'] / 2**20:>13.1f} "
                  f"{r['measured'] / max(r['predicted'], 1):>19.2f}")


if __name__ == "__main__":
    main()
