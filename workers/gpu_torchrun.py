"""Entry point of the gpu worker under torchrun: one trainer sharded with FSDP2 over all ranks.

    torchrun --nproc-per-node 8 -m workers.gpu_torchrun [extra celery worker options]
    torchrun --nnodes 2 --node-rank R --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
             --nproc-per-node 8 -m workers.gpu_torchrun          (one command per machine)

Rank 0 is the Celery worker of queue `gpu` (`workers.gpu_worker`'s options with the solo
pool: the step must run in the process that holds the process group and its shard of the
model, so there is no pool child).  Ranks > 0 wait in `app.training.trainer.follow` and replay
rank 0's trainer calls (build, update, save, load) with the same arguments; see
`app.training.distributed`.  Checkpoints (`TURNSTILE_VAR_DIR`) must be on a filesystem every
rank sees.  If any rank dies, torchrun stops them all; the watchdog re-sends the step, which
resumes from the newest sharded checkpoint.  For a single process use `workers.gpu_worker`.
"""
from __future__ import annotations

import sys


def argv(extra: list[str] | None = None) -> list[str]:
    """Rank 0's `celery worker` arguments: `workers.gpu_worker.argv` with the solo pool."""
    from workers.gpu_worker import argv as gpu_argv

    args = gpu_argv(extra)
    pool = args.index("-P")
    return args[: pool + 1] + ["solo"] + args[pool + 2 :]


def main(extra: list[str] | None = None) -> None:
    from app.training import distributed
    from app.training.trainer import follow

    group = distributed.init_from_env()
    if group is None:
        raise SystemExit("workers.gpu_torchrun runs under torchrun with 2 or more processes; "
                         "for one process use workers.gpu_worker")
    if not group.leader:
        follow(group)
        return
    from app.celery import app

    app.worker_main(argv(extra if extra is not None else sys.argv[1:]))


if __name__ == "__main__":
    main()
