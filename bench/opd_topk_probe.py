"""Does a student that never samples the teacher's first token get there? The sampled-token reverse
KL (what `app.training.opd` trains) against a forward KL to the teacher's top-k, side by side, on
the prompts a distillation run recorded.

Usage (after a distillation train run, e.g. the OPD arm of `bench/distill_demo.py`)::

    .venv/bin/python bench/opd_topk_probe.py RUN_ID [--steps 8] [--prompts 4] [--samples 2] [--tokens 24]

A probe, not the trainer: each arm starts from the packaged SmolLM2 with a fresh LoRA (r 16,
alpha 32, as the demonstration) and AdamW at `--lr`, and runs `--steps` on-policy steps on the
first-call prompts of `--prompts` episodes of run RUN_ID.  Per step and prompt it samples
`--samples` answers of `--tokens` tokens (T = 1, no truncation), then, at each answer position t:

* ``sampled``: loss = -mean_t sg(log pi_T(y_t) - log pi_S(y_t)) * log pi_S(y_t), the per-token
  reverse-KL advantage of Thinking Machines' on-policy distillation (no baseline);
* ``topk``: loss = mean_t sum_{v in K_t} q_t(v) (log q_t(v) - log pi_S(v)), q_t the teacher's
  distribution renormalised over its `--topk` likeliest tokens K_t: a forward KL on the
  student's own prefixes (GKD, Agarwal et al. 2024, arXiv:2306.13649 §3), which reaches tokens
  the student did not sample.

Printed per step: the student's probability of the teacher's first token at the answer's first
position (mean over prompts; the teacher's own is near 1 on the demonstration), the share of
sampled answers that start with it, and the reverse KL per token of the step's samples; after
the last step, one sampled answer per prompt.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from sqlalchemy import select

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.db import session_scope  # noqa: E402
from app.engines.modeling import load_model  # noqa: E402
from app.runconfig import RunConfig  # noqa: E402
from app.tables import Completion, Episode, Run  # noqa: E402
from app.training import policy  # noqa: E402
from app.training.teacher_scorers import teacher_spec  # noqa: E402


def first_prompts(run_id: int, count: int) -> tuple[str, list[list[int]]]:
    """(teacher spec, the first-call prompt ids of `count` episodes of distinct instances)."""
    with session_scope() as s:
        run = s.get(Run, run_id)
        if run is None:
            raise SystemExit(f"no run {run_id}")
        choice = RunConfig.model_validate(run.config).training.teacher
        if choice is None:
            raise SystemExit(f"run {run_id} has no teacher")
        rows = s.execute(select(Episode.instance_id, Completion.prompt_ids)
                         .join(Episode, Episode.id == Completion.episode_id)
                         .where(Episode.run_id == run_id, Completion.seq == 0, Completion.prompt_ids.is_not(None))
                         .order_by(Completion.id)).all()
    prompts: dict[int, list[int]] = {}
    for instance, ids in rows:
        prompts.setdefault(instance, list(ids))
    if len(prompts) < count:
        raise SystemExit(f"run {run_id} has first calls of {len(prompts)} instances, fewer than {count}")
    return teacher_spec(choice), list(prompts.values())[:count]


def answer_logprobs(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """log-softmax [len(answer), vocab] at the positions that predict each answer token."""
    ids = torch.tensor([prompt + answer])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(answer)]
    return torch.log_softmax(logits.float(), -1)


def sample(model, prompt: list[int], tokens: int, generator: torch.Generator) -> list[int]:
    """`tokens` ids drawn from the model at T = 1 with no truncation (KV cache, one id at a time)."""
    out, past, ids = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(tokens):
            step = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = step.past_key_values
            probs = torch.softmax(step.logits[0, -1].float(), -1)
            token = int(torch.multinomial(probs, 1, generator=generator))
            out.append(token)
            ids = torch.tensor([[token]])
    return out


def run_arm(arm: str, teacher, prompts: list[list[int]], args) -> list[dict]:
    torch.manual_seed(0)
    student, _ = load_model("smollm2", torch.float32)
    student = policy.add_lora(student, 16, 32, 0.0)
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=args.lr)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        target = [int(answer_logprobs(teacher, p, [0])[0].argmax()) for p in prompts]  # teacher's first token
    rows = []
    for step in range(args.steps + 1):
        started = time.monotonic()
        student.eval()
        with torch.no_grad():
            p_first = sum(float(answer_logprobs(student, p, [0])[0, t].exp()) for p, t in zip(prompts, target)) / len(prompts)
        batch = [(i, sample(student, p, args.tokens, generator)) for i, p in enumerate(prompts) for _ in range(args.samples)]
        starts = sum(answer[0] == target[i] for i, answer in batch) / len(batch)
        if step == args.steps:  # the last row measures only, and shows what the student now writes
            rows.append({"step": step, "p_first": p_first, "starts": starts})
            for i, answer in batch[::args.samples]:
                print(f"{arm} after {step} steps, prompt {i}: {args.tokenizer.decode(answer)!r}", flush=True)
            break
        student.train()
        optimizer.zero_grad(set_to_none=True)
        kl = 0.0
        for i, answer in batch:
            with torch.no_grad():
                lt = answer_logprobs(teacher, prompts[i], answer)
            ls = answer_logprobs(student, prompts[i], answer)
            idx = torch.tensor(answer)[:, None]
            d = (lt.gather(1, idx) - ls.gather(1, idx)).squeeze(1).detach()
            kl += float(-d.mean())
            if arm == "sampled":
                loss = -(d * ls.gather(1, idx).squeeze(1)).mean()
            else:
                top = torch.topk(lt, args.topk, dim=-1)
                q = torch.softmax(top.values, -1)  # the teacher's top-k, renormalised
                loss = (q * (torch.log(q) - ls.gather(1, top.indices))).sum(-1).mean()
            (loss / len(batch)).backward()
        optimizer.step()
        rows.append({"step": step, "p_first": p_first, "starts": starts, "reverse_kl": kl / len(batch),
                     "seconds": time.monotonic() - started})
        print(f"{arm} step {step}: p(teacher's first token) {p_first:.4f}, answers starting with it {starts:.2f}, "
              f"reverse KL {kl / len(batch):.3f}, {time.monotonic() - started:.0f} s", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_id", type=int)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--arms", default="sampled,topk")
    args = ap.parse_args()
    spec, prompts = first_prompts(args.run_id, args.prompts)
    teacher, args.tokenizer = load_model(spec, torch.float32)
    teacher.eval()
    results = {arm: run_arm(arm, teacher, prompts, args) for arm in args.arms.split(",")}
    print(f"\nrun {args.run_id}, teacher {spec}; {args.prompts} prompts x {args.samples} samples of {args.tokens} tokens, "
          f"lr {args.lr}, top-{args.topk}")
    print("| step | " + " | ".join(f"{a}: p(first) | {a}: starts | {a}: reverse KL" for a in results) + " |")
    print("|---|" + "---|---|---|" * len(results))
    for step in range(args.steps + 1):
        cells = []
        for rows in results.values():
            r = rows[step]
            kl = f"{r['reverse_kl']:.3f}" if "reverse_kl" in r else "-"
            cells.append(f"{r['p_first']:.4f} | {r['starts']:.2f} | {kl}")
        print(f"| {step} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
