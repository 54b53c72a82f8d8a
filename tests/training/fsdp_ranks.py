"""The ranks of test_training_fsdp.py, started by torchrun with the gloo backend (CPU).

    torchrun --standalone --nproc-per-node 2 tests/training/fsdp_ranks.py OUT_DIR

Rank 0 leads exactly as the gpu worker's Celery task would (Trainer.from_spec, update, save,
load); rank 1 follows (`app.training.trainer.follow`).  Rank 0 runs: step 1, a sharded save
(OUT/step1), a fresh trainer resumed from it, step 2, a save (OUT/step2), and writes the two
steps' metrics to OUT/metrics.json.  The test compares them with one process running the same
two steps.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

from app.runconfig import TrainingConfig
from app.training.batching import StepSequence

LR = 1e-3


def config() -> TrainingConfig:
    """Packed micro-batches of at most 128 tokens, checkpointed layers (the CUDA default), clipping on."""
    return TrainingConfig(learning_rate=LR, micro_batch_tokens=128, packing=True, activation_checkpointing=True,
                          max_grad_norm=0.3)


def masked_config() -> TrainingConfig:
    """`config` with an IcePop mask and per-episode aggregation: the kept-token counts that set
    the step's weights are summed over the ranks (app.training.correction.mask_weights)."""
    return config().model_copy(update={"off_policy_correction": ["icepop", "token_tis"], "icepop_bounds": [0.15, 2.0],
                                       "loss_aggregation": "sequence"})


def step_sequences(seed: int) -> list[StepSequence]:
    """Five sequences packing into three micro-batches ([100], [90+30], [80+40] tokens), so
    that rank 1 gets a zero-weight filler; the 100-token one has advantage 0 (its backward
    is skipped on rank 0 while rank 1 needs one at the same position)."""
    rng = random.Random(seed)
    out = []
    for i, (n, advantage) in enumerate([(100, 0.0), (90, 1.0), (80, -1.0), (40, 0.5), (30, -0.5)]):
        ids = [rng.randrange(3, 49000) for _ in range(n)]
        mask = [0] * (n // 3) + [1] * (n - n // 3)
        lps = [-10.0 + rng.random() if m else 0.0 for m in mask]
        out.append(StepSequence(ids, mask, lps, advantage, episode_id=i))
    return out


def main(out: Path) -> None:
    torch.set_num_threads(1)
    from app.training import distributed
    from app.training.trainer import Trainer, follow, stop_followers

    group = distributed.init_from_env("gloo")
    assert group is not None and group.world == 2, group
    if not group.leader:
        follow(group)
        return
    try:
        trainer = Trainer.from_spec(config(), "tiny")
        first = trainer.update(step_sequences(1))
        trainer.save(out / "step1", {"policy_version": 1})
        resumed = Trainer.from_spec(config(), "tiny")
        del trainer
        state = resumed.load(out / "step1")
        second = resumed.update(step_sequences(2))
        resumed.save(out / "step2", {"policy_version": 2})
        del resumed
        masked = Trainer.from_spec(masked_config(), "tiny").update(step_sequences(3))
    finally:
        stop_followers(group)
    (out / "metrics.json").write_text(json.dumps({"first": first, "second": second, "state": state, "masked": masked}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
