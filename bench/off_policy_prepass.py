"""Trainer step time by `training.off_policy_correction`: what a mask's no-grad pre-pass costs.

    .venv/bin/python bench/off_policy_prepass.py                         # tiny model
    .venv/bin/python bench/off_policy_prepass.py --model smollm2 --prompt 1024 --repeats 2

A step of `--chains` chains of `--prompt` + `--sampled` tokens, every advantage nonzero, rollout
logprobs near the trainer's (so nothing is masked and every arm does the same work but the
pre-pass).  Arms: token_tis (no pre-pass), seq_tis (a chain weight, no pre-pass), geo_mask and
icepop (a mask: one no-grad forward of every micro-batch first).  Each arm starts from the same
weights and runs `Trainer.update` `--repeats` times, the arms interleaved after one warm-up step;
printed: median seconds per step and its ratio to token_tis.  CPU, one torch thread unless
`--threads`.
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
from app.training.trainer import Trainer  # noqa: E402
from bench.step_timing import interleaved_arms  # noqa: E402

ARMS = (["token_tis"], ["seq_tis"], ["geo_mask", "token_tis"], ["icepop"])


def sequences(chains: int, prompt: int, sampled: int, vocab: int, seed: int) -> list[StepSequence]:
    rng = random.Random(seed)
    return [StepSequence([rng.randrange(3, vocab) for _ in range(prompt + sampled)], [0] * prompt + [1] * sampled,
                         [0.0] * (prompt + sampled), 1.0 if i % 2 else -1.0, episode_id=i) for i in range(chains)]


def on_policy(trainer: Trainer, seqs: list[StepSequence]) -> list[StepSequence]:
    """`seqs` with the trainer's own logprobs as rollout logprobs: every ratio 1, nothing masked."""
    out = []
    for seq, lp in zip(seqs, trainer.logprobs(seqs)):
        it = iter(lp.tolist())
        out.append(StepSequence(seq.token_ids, seq.loss_mask, [next(it) if m else 0.0 for m in seq.loss_mask],
                                seq.advantage, seq.episode_id))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--chains", type=int, default=8)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--sampled", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    vocab = 49152 if args.model == "smollm2" else 1000
    seqs = sequences(args.chains, args.prompt, args.sampled, vocab, seed=0)
    arms = {"+".join(modes): TrainingConfig(learning_rate=1e-4, micro_batch_tokens=2048, off_policy_correction=modes)
            for modes in ARMS}
    steps = interleaved_arms(arms, args.model, seqs, args.repeats, prepare=on_policy)
    times = {name: arm.seconds for name, arm in steps.items()}
    masked = {name: arm.metrics["off_policy"]["tokens_masked_fraction"] for name, arm in steps.items()}
    print(f"model {args.model}, {args.chains} chains of {args.prompt}+{args.sampled} tokens, "
          f"{args.threads} thread(s), {args.repeats} repeats")
    base = statistics.median(times["token_tis"])
    print(f"{'correction':22}{'step, median (s)':>18}{'x token_tis':>13}{'masked':>9}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:22}{median:>18.2f}{median / base:>13.2f}{masked[name]:>9.3f}")


if __name__ == "__main__":
    main()
