"""The trainer's loss heads side by side: plain, checkpointed (the earlier head) and fused.

    .venv/bin/python bench/loss_head.py [--device cpu|cuda] [--positions 2600] [--hidden 64] [--vocab 49152]

For N sampled positions of a d-wide model with a V-token head it runs forward + backward of
logp = log_softmax(h W^T)[target] with each head (`app.training.policy.token_logprobs`'s
three heads, on the bare head so the body does not hide them), each in a fresh process, and
prints the process CPU time (best of 2) and the peak memory of the pass above the memory held
before it (CPU: VmHWM with glibc's mmap threshold at 64 KiB; CUDA: max_memory_allocated).
Defaults: the prefix-merging bench's merged chain at the tiny shape (2,600 sampled positions).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

HEADS = ("plain", "checkpointed", "fused")


def _status(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def probe(head: str, n: int, d: int, vocab: int, device: torch.device) -> dict:
    from torch.utils.checkpoint import checkpoint

    from app.training import policy
    from app.training.head import fused_token_logprobs

    torch.manual_seed(0)
    lm_head = torch.nn.Linear(d, vocab, bias=False).to(device)
    hidden = torch.randn(n, d, device=device, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), device=device)

    def step():
        if head == "fused":
            out = fused_token_logprobs(hidden, lm_head.weight, targets)
        elif head == "checkpointed":
            chunk = max(1, policy.HEAD_CHUNK_ELEMENTS // vocab)
            out = torch.cat([checkpoint(policy._head_logprobs, lm_head, hidden[i:i + chunk], targets[i:i + chunk],
                                        use_reentrant=False) for i in range(0, n, chunk)])
        else:
            out = policy._head_logprobs(lm_head, hidden, targets)
        out.sum().backward()

    step()  # warm: gradient buffers exist
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        before = _status("VmRSS")
    best = float("inf")
    for _ in range(2):
        started = time.perf_counter() if device.type == "cuda" else time.process_time()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() if device.type == "cuda" else time.process_time()) - started)
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else _status("VmHWM")) - before
    return {"head": head, "seconds": best, "peak": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--positions", type=int, default=2600)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--probe", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.probe:
        print(json.dumps(probe(args.probe, args.positions, args.hidden, args.vocab, device)))
        return
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    clock = "wall" if device.type == "cuda" else "CPU"
    print(f"{args.positions} positions, d={args.hidden}, vocab={args.vocab}, {device.type}")
    print(f"{'head':<14}{clock + ' s':>9}{'peak MiB':>11}")
    for head in HEADS:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe", head, "--device", args.device,
                              "--positions", str(args.positions), "--hidden", str(args.hidden), "--vocab",
                              str(args.vocab)], capture_output=True, text=True, env=env, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{head:<14}{r['seconds']:>9.2f}{r['peak'] / 2**20:>11.1f}")


if __name__ == "__main__":
    main()
