"""Entry point of the gpu worker: one Celery process per accelerator, queue `gpu` only.

    python -m workers.gpu_worker [extra celery worker options]

Equivalent to `celery -A app worker -Q gpu -c 1 -P prefork -n gpu@%h
--prefetch-multiplier 1 --without-mingle --without-gossip`, with the training-specific choices in one place:

* prefork with a single child: the parent never imports torch (it is imported in the
  child by the first `gpu.train_step`), so CUDA is initialised only after fork
  (pytorch/pytorch#40403; celery#3402);
* no `--max-tasks-per-child`: the child keeps the model and AdamW state resident between
  steps; a new child (after a crash) reloads them from the newest checkpoint;
* prefetch 1 and early ack for this queue (app.tasks.training): one step at a time.

`CUDA_VISIBLE_DEVICES` picks the GPU; run one such worker per GPU with distinct `-n` names.
"""
from __future__ import annotations

import sys


def argv(extra: list[str] | None = None) -> list[str]:
    """The `celery worker` arguments this entry point uses (plus `extra`)."""
    return [
        "worker",
        "-Q", "gpu",
        "-c", "1",
        "-P", "prefork",
        "-n", "gpu@%h",
        "--prefetch-multiplier", "1",
        "--without-mingle",
        "--without-gossip",  # gossip's restart after a lost broker connection crashes the worker (app/celery.py)
        *(extra or []),
    ]


def main(extra: list[str] | None = None) -> None:
    if "torch" in sys.modules:  # pragma: no cover - a guard against future imports in app/
        raise RuntimeError("torch was imported in the gpu worker's parent process; import it in the task body")
    from app.celery import app

    app.worker_main(argv(extra if extra is not None else sys.argv[1:]))


if __name__ == "__main__":
    main()
