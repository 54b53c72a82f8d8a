"""How many torch intra-op threads the trainer (and a local OPD teacher scorer) uses on CPU.

On a CPU deployment the trainer shares the box with the embedded engine (`engine_threads` busy
threads while rollouts run) and with the rollouts themselves (harness processes, test runs).
torch's default is one intra-op thread per core; when fewer cores are free than threads, each
parallel region (a matmul split across threads) ends at a barrier that waits for a thread the OS
has descheduled, so a step gets slower with more threads.  Measured on a 2-core box with the
engine and 8 mini-swe-agent rollouts running (`bench/zero_advantage_step.py --model smollm2
--groups 2 --uniform 0`, 8.7k tokens): 101-173 s per step with 1 thread, 355-415 s with 2.
On CUDA the thread count hardly matters and is left as torch sets it.
"""
from __future__ import annotations

import os

from app.config import Settings, get_settings


def cores() -> int:
    """CPUs this process may run on (its affinity mask, else `os.cpu_count()`), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def trainer_threads(settings: Settings | None = None, available: int | None = None) -> int:
    """The trainer's CPU intra-op threads: `settings.trainer_threads` when set, else
    `available` (default `cores()`) less the engine's `engine_threads` and one core for the
    rollouts, at least 1.  Returns an int >= 1."""
    settings = settings or get_settings()
    if settings.trainer_threads is not None:
        return settings.trainer_threads
    return max(1, (available if available is not None else cores()) - settings.engine_threads - 1)


def apply_cpu_threads(settings: Settings | None = None, device=None) -> int | None:
    """Set torch's intra-op threads to `trainer_threads()` when the work runs on the CPU: `device`
    (a `torch.device` or its name; default CUDA where present, else CPU, as the trainer picks).
    Returns the count set, or None for a CUDA device (the count is left as torch chose)."""
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cpu":
        return None
    n = trainer_threads(settings)
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n
