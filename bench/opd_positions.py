"""Where an OPD run's distillation advantage goes, position by position: the teacher's and the
student's logprob of each token the student sampled, and the teacher's own top tokens there.

Usage (after a distillation train run, e.g. the OPD arm of `bench/distill_demo.py`)::

    .venv/bin/python bench/opd_positions.py RUN_ID [--versions 0,5] [--calls 1] [--positions 12]

For each policy version asked, the first `--calls` recorded model calls of run RUN_ID sampled by
that version: per answer position, the sampled token, log pi_T (the run's teacher, scored here
by the `teacher` worker's own `score_with_model`, one fp32 prefill), log pi_S (the logprob the gateway
recorded when the student sampled it) and d = log pi_T - log pi_S, the distillation advantage
of `app.training.opd` before any baseline; then the teacher's three likeliest tokens.  Then, per
version over all its calls: mean d, d at the answer's first token, and the share of sampled
tokens both models give more than 0.9 (where d is about 0, the largest advantage under a step-mean
baseline when the mean is negative).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from sqlalchemy import select

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.db import session_scope  # noqa: E402
from app.engines.modeling import load_model  # noqa: E402
from app.runconfig import RunConfig  # noqa: E402
from app.tables import Completion, Episode, Run  # noqa: E402
from app.training.teacher_scorers import score_with_model, teacher_spec  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_id", type=int)
    ap.add_argument("--versions", default=None, help="policy versions to print position by position (default: first, last)")
    ap.add_argument("--calls", type=int, default=1, help="calls printed per version")
    ap.add_argument("--positions", type=int, default=12, help="answer positions printed per call")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with session_scope() as s:
        run = s.get(Run, args.run_id)
        if run is None:
            raise SystemExit(f"no run {args.run_id}")
        choice = RunConfig.model_validate(run.config).training.teacher
        if choice is None:
            raise SystemExit(f"run {args.run_id} has no teacher (training.algorithm is grpo)")
        rows = s.execute(select(Completion.policy_version, Completion.prompt_ids, Completion.sampled_ids,
                                Completion.logprobs)
                         .join(Episode, Episode.id == Completion.episode_id)
                         .where(Episode.run_id == args.run_id, Completion.sampled_ids.is_not(None))
                         .order_by(Completion.id)).all()
    if not rows:
        raise SystemExit(f"run {args.run_id} recorded no sampled calls")
    model, tokenizer = load_model(teacher_spec(choice), torch.float32)
    model.eval()
    by_version: dict[int, list] = defaultdict(list)
    for version, prompt, sampled, logprobs in rows:
        by_version[version].append((list(prompt), list(sampled), list(logprobs)))
    versions = sorted(by_version)
    shown = [int(v) for v in args.versions.split(",")] if args.versions else sorted({versions[0], versions[-1]})
    print(f"run {args.run_id}, teacher {teacher_spec(choice)}; {len(rows)} calls at versions {versions}")
    for version in versions:
        d_all, d_first, sure, n = [], [], 0, 0
        for k, (prompt, sampled, student) in enumerate(by_version[version]):
            # The teacher worker's own scorer: log pi_T of each sampled token, one fp32 prefill.
            teacher = score_with_model(model, prompt + sampled, [0] * len(prompt) + [1] * len(sampled))[len(prompt):]
            d = [t - s for t, s in zip(teacher, student)]
            d_all += d
            d_first.append(d[0])
            sure += sum(1 for t, s in zip(teacher, student) if min(t, s) > -0.105)  # both p > 0.9
            n += len(d)
            if version in shown and k < args.calls:
                with torch.no_grad():  # the whole distribution, for the teacher's top tokens
                    logp = torch.log_softmax(model(input_ids=torch.tensor([prompt + sampled])).logits[0].float(), -1)
                at = logp[len(prompt) - 1:len(prompt) - 1 + len(sampled)]  # position t predicts token t + 1
                print(f"\nversion {version}, call {k}: {tokenizer.decode(sampled)[:160]!r}")
                for i in range(min(args.positions, len(sampled))):
                    top = torch.topk(at[i], 3)
                    tops = ", ".join(f"{tokenizer.decode([j])!r} {v:.2f}" for v, j in zip(top.values.tolist(), top.indices.tolist()))
                    print(f"  {i:3d} {tokenizer.decode([sampled[i]])!r:>14}  log pi_T {teacher[i]:7.2f}  "
                          f"log pi_S {student[i]:7.2f}  d {d[i]:7.2f}   teacher's top: {tops}")
        print(f"version {version}: {len(by_version[version])} calls, mean d {sum(d_all) / n:.3f}, "
              f"d at the first token {sum(d_first) / len(d_first):.2f}, both sure (p > 0.9) on {sure / n:.1%} of tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
