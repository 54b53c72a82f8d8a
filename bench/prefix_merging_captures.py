"""Trainer cost of `per_request` versus `prefix_merging` on sessions captured by `harness check`.

    .venv/bin/python -m app harness check NAME --keep DIR      # once per harness: DIR/NAME/check.db
    .venv/bin/python -m app harness check NAME --keep TEXT --no-splice   # optional: the same, rendered from text
    .venv/bin/python bench/prefix_merging_captures.py --from DIR [--text-from TEXT] [--device cpu|cuda]
        [--max-step-tokens N]

Where `bench/prefix_merging.py` synthesizes sessions, this one reads the completions a real
harness CLI made through the real gateway (prompt ids, sampled ids, logprobs as recorded;
the scripted engine behind `harness check` spends one token per UTF-8 byte, so these prompts
are about 4x longer than in a BPE tokenizer).  Per harness it builds both kinds of
trajectories and runs one real GRPO step per builder (`Trainer.update`, a fresh tiny model
each), side by side in one process, and prints: calls, calls the gateway spliced from sampled
ids, chains, merge fidelity (as `harness check` reports it), sequences, tokens processed,
trainable tokens, step wall time and CPU time per builder (CPU time is the steadier figure on a
shared box), and the token and time ratios.  With `--text-from`
a third row per harness builds `prefix_merging` over the same harness's captures made with
splicing off (every turn rendered from the harness's text): what merging achieves without it.

Each harness's completions form one episode with advantage 1.0 (the step's cost does not
depend on the values).  A builder whose longest sequence exceeds `--max-step-tokens` is not
stepped (its tokens are still counted): on CPU a tiny-model step costs about a minute at 16k
tokens and its attention mask grows with the square of the length (default 20000 on CPU,
no limit on CUDA).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from sqlalchemy import create_engine, select  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

from app.conformance.harness_check import merge_fidelity  # noqa: E402
from app.engines.modeling import build_tiny_model  # noqa: E402
from app.tables import Completion  # noqa: E402
from app.runconfig import TrainingConfig  # noqa: E402
from app.training.batching import StepSequence  # noqa: E402
from app.training.trainer import Trainer  # noqa: E402
from app.training.trajectories import CompletionRecord, per_request, prefix_merging  # noqa: E402


def load_captures(path: Path) -> list[Completion]:
    """The completions of the one episode in a `harness check` database, in arrival order."""
    engine = create_engine(f"sqlite:///{path}")
    try:
        with Session(engine) as s:
            rows = list(s.execute(select(Completion).order_by(Completion.episode_id, Completion.seq)).scalars())
            s.expunge_all()
        return rows
    finally:
        engine.dispose()


def step(sequences: list[StepSequence], device: torch.device, micro_batch_tokens: int) -> tuple[float, float]:
    """One `Trainer.update` on a fresh tiny model: (wall seconds, CPU seconds of this process)."""
    longest = max(len(s.token_ids) for s in sequences)
    config = TrainingConfig(learning_rate=1e-6, micro_batch_tokens=max(micro_batch_tokens, 16),
                            max_sequence_tokens=longest + 16)
    trainer = Trainer(config, build_tiny_model(0).to(device))
    started, cpu_started = time.perf_counter(), time.process_time()
    trainer.update(sequences)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started, time.process_time() - cpu_started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--from", dest="source", required=True, help="folder with NAME/check.db per harness")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--max-step-tokens", type=int, default=None,
                        help="step a builder only if its longest sequence is this long at most")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--text-from", default=None, help="folder with NAME/check.db made with --no-splice")
    args = parser.parse_args()
    device = torch.device(args.device)
    limit = args.max_step_tokens if args.max_step_tokens is not None else (20000 if device.type == "cpu" else 10**9)
    dbs = sorted(Path(args.source).glob("*/check.db"))
    if not dbs:
        raise SystemExit(f"no */check.db under {args.source}: run `python -m app harness check NAME --keep DIR` first")
    print(f"{'harness':<15}{'calls':>6}{'spliced':>8}{'chains':>7}{'fidelity':>9}  "
          f"{'builder':<15}{'seqs':>5}{'tokens':>9}{'trainable':>10}{'longest':>9}{'step s':>9}{'cpu s':>8}")
    totals = {"per_request": [0, 0.0], "prefix_merging": [0, 0.0], "merging, text": [0, 0.0]}
    timed_both = True
    for db in dbs:
        rows = load_captures(db)
        records = [CompletionRecord(r.seq, r.prompt_ids, r.sampled_ids, r.logprobs, r.finish_reason, r.id)
                   for r in rows]
        spliced = sum(1 for r in rows if "completion" in ((r.raw_request or {}).get("splice") or {}))
        results = {}
        runs = [("per_request", per_request, records), ("prefix_merging", prefix_merging, records)]
        text_db = Path(args.text_from) / db.parent.name / "check.db" if args.text_from else None
        if text_db is not None and text_db.exists():
            text_records = [CompletionRecord(r.seq, r.prompt_ids, r.sampled_ids, r.logprobs, r.finish_reason, r.id)
                            for r in load_captures(text_db)]
            runs.append(("merging, text", prefix_merging, text_records))
        for name, builder, recs in runs:
            built = builder(recs)
            seqs = [StepSequence(s.token_ids, s.loss_mask, s.logprobs, 1.0) for s in built.sequences]
            longest = max((len(s.token_ids) for s in seqs), default=0)
            seconds = cpu = None
            if seqs and longest <= limit:
                seconds, cpu = step(seqs, device, args.micro_batch_tokens)
            results[name] = (built, seqs, longest, seconds, cpu)
        fidelity = merge_fidelity(rows, results["prefix_merging"][0].sequences)["fidelity"]
        chains = results["prefix_merging"][0].report["chains"]
        for i, (name, (built, seqs, longest, seconds, cpu)) in enumerate(results.items()):
            tokens = built.report["tokens"]
            head = (f"{db.parent.name:<15}{len(rows):>6}{spliced:>8}{chains:>7}"
                    f"{fidelity if fidelity is not None else '-':>9}  ") if i == 0 else " " * 47
            shown = f"{seconds:>9.2f}{cpu:>8.2f}" if seconds is not None else f"{'skipped':>9}{'':>8}"
            print(f"{head}{name:<15}{len(seqs):>5}{tokens:>9}{built.report['trainable_tokens']:>10}{longest:>9}{shown}")
            totals[name][0] += tokens
            if seconds is None:
                timed_both = False
            else:
                totals[name][1] += seconds
        pr, pm = results["per_request"], results["prefix_merging"]
        ratio_t = pr[0].report["tokens"] / max(pm[0].report["tokens"], 1)
        ratio_s = f"{pr[3] / pm[3]:.2f}x (CPU time {pr[4] / pm[4]:.2f}x)" if pr[3] and pm[3] else "n/a"
        text = results.get("merging, text")
        extra = (f"; merging without splicing: {text[0].report['tokens'] / max(pm[0].report['tokens'], 1):.2f}x "
                 f"the tokens of merging with it") if text else ""
        print(f"{'':47}tokens per_request / prefix_merging {ratio_t:.2f}x, step time {ratio_s}{extra}")
    pr_t, pm_t = totals["per_request"][0], totals["prefix_merging"][0]
    tx_t = totals["merging, text"][0]
    print(f"all harnesses: tokens per_request {pr_t}, prefix_merging {pm_t} ({pr_t / max(pm_t, 1):.2f}x)"
          f"{f', prefix_merging without splicing {tx_t}' if tx_t else ''}; "
          f"step seconds per_request {totals['per_request'][1]:.1f}, prefix_merging {totals['prefix_merging'][1]:.1f}"
          f"{'' if timed_both else ' (timed steps only; see skipped)'}; device {device}, step limit {limit} tokens")


if __name__ == "__main__":
    main()
