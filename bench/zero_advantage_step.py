"""Trainer step time with and without `training.skip_zero_advantage`, side by side.

    .venv/bin/python bench/zero_advantage_step.py                       # tiny model, 4 groups, half uniform
    .venv/bin/python bench/zero_advantage_step.py --model smollm2 --prompt 1024 --repeats 2

A step of `--groups` groups of `--group-size` chains (each `--prompt` prompt tokens and
`--sampled` sampled tokens, the shape of a mini-swe-agent episode on the starter and family
sets); `--uniform` of the groups have equal rewards (advantage 0 on every chain, the groups
that dynamic sampling trains once its cap is reached).  Each arm starts from the same weights
and runs `Trainer.update` `--repeats` times, the arms interleaved after one warm-up step; printed: median seconds per step, tokens through
the model, and the largest weight difference between the arms after one step (the update must
be the same).  CPU, one torch thread unless `--threads`.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.runconfig import TrainingConfig  # noqa: E402
from app.training.batching import StepSequence  # noqa: E402
from bench.step_timing import interleaved_arms  # noqa: E402


def sequences(groups: int, size: int, uniform: int, prompt: int, sampled: int, vocab: int, seed: int) -> list:
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        advantages = [0.0] * size if g < uniform else [0.75, -0.25, -0.25, -0.25][:size] + [0.0] * max(0, size - 4)
        for adv in advantages:
            ids = [rng.randrange(3, vocab) for _ in range(prompt + sampled)]
            out.append(StepSequence(ids, [0] * prompt + [1] * sampled, [0.0] * prompt + [-2.0] * sampled, adv))
    return out


def weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--uniform", type=int, default=2, help="groups whose advantages are all 0")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--sampled", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    vocab = 49152 if args.model == "smollm2" else 1000
    seqs = sequences(args.groups, args.group_size, args.uniform, args.prompt, args.sampled, vocab, seed=0)
    arms = {skip: TrainingConfig(learning_rate=1e-4, skip_zero_advantage=skip, micro_batch_tokens=2048)
            for skip in (False, True)}
    steps = interleaved_arms(arms, args.model, seqs, args.repeats, keep=weights)
    (off_t, off_m, off_w), (on_t, on_m, on_w) = ((a.seconds, a.metrics, a.kept) for a in steps.values())
    diff = max(float((on_w[k] - off_w[k]).abs().max()) for k in on_w)
    print(f"model {args.model}, {args.groups} groups x {args.group_size} chains of {args.prompt}+{args.sampled} "
          f"tokens, {args.uniform} uniform groups, {args.threads} thread(s), {args.repeats} repeats")
    print(f"{'':28}{'scored (before)':>18}{'skipped (after)':>18}")
    print(f"{'step time, median (s)':28}{statistics.median(off_t):>18.2f}{statistics.median(on_t):>18.2f}")
    print(f"{'tokens through the model':28}{off_m['tokens_processed']:>18}{on_m['tokens_processed']:>18}")
    print(f"{'chains left out':28}{off_m['sequences_zero_advantage_skipped']:>18}"
          f"{on_m['sequences_zero_advantage_skipped']:>18}")
    print(f"{'loss':28}{off_m['loss']:>18.6f}{on_m['loss']:>18.6f}")
    print(f"largest weight difference between the arms after the step: {diff:.2e}")


if __name__ == "__main__":
    main()
