"""Trainer cost of `per_request` versus `prefix_merging` on the same multi-turn sessions.

    .venv/bin/python bench/prefix_merging.py [--episodes 2] [--seed 0] [--micro-batch-tokens 8192]

Synthesizes agent sessions with realistic sizes (20–50 model calls per episode; a system +
task prompt of ~500 tokens; per call a few hundred new tokens: sampled ids plus a tool result
in ChatML glue; sessions end below SmolLM2's 8192-token context), records rollout logprobs
with the tiny model, builds both kinds of trajectories, and runs one real GRPO step
(`Trainer.update`, fresh tiny model each) per builder, side by side in one process.

Printed: sequences, tokens processed, trainable tokens, step wall and CPU time per builder; the
token ratio and the time ratio (per_request / prefix_merging); and the work ratio of an
analytic FLOP model of this trainer (linear layers per token + causal attention per
sequence + LM head per *sampled* token), for the tiny model and, as a projection, for
SmolLM2-135M.  Polar reports 5.39x less training time with prefix merging; with cost
proportional to tokens the limit is the token ratio.  Our trainer computes the LM head only at
sampled positions, so the cost that merging removes (context tokens) is the body; on the tiny
model (3.1M of its 3.2M parameters are the 49k-vocab embedding/head, 2 layers of width 64)
the time goes to attention and to the head over sampled tokens, which merging does not
reduce.  The time ratio should therefore be compared with the work ratio of the same model.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from app.engines.modeling import build_tiny_model, tiny_config  # noqa: E402
from app.training.batching import StepSequence  # noqa: E402
from app.runconfig import TrainingConfig  # noqa: E402
from app.training.grpo import group_advantages  # noqa: E402
from app.training.trainer import Trainer  # noqa: E402
from app.training.trajectories import CompletionRecord, per_request, prefix_merging  # noqa: E402

IM_START, IM_END, NL = 1, 2, 198  # SmolLM2 ChatML ids
CONTEXT = 8192


def synth_session(rng: random.Random) -> list[CompletionRecord]:
    """One episode: calls whose prompts extend the previous prompt + sampled ids (no logprobs yet)."""
    calls = rng.randint(20, 50)
    prompt = [IM_START] + [rng.randrange(3, 49000) for _ in range(rng.randint(400, 600))] + [IM_END, NL, IM_START]
    per_call = min(300, (CONTEXT - len(prompt) - 64) // calls)  # "a few hundred" new tokens per call
    records = []
    for seq in range(calls):
        n_sampled = rng.randint(per_call // 4, per_call // 2)
        sampled = [rng.randrange(3, 49000) for _ in range(n_sampled - 1)] + [IM_END]
        tool = [rng.randrange(3, 49000) for _ in range(per_call - n_sampled - 6)]
        records.append(CompletionRecord(seq=seq, prompt_ids=list(prompt), sampled_ids=sampled, logprobs=None,
                                        finish_reason="stop"))
        prompt = prompt + sampled + [NL, IM_START] + tool + [IM_END, NL, IM_START]
    return records


def with_rollout_logprobs(trainer: Trainer, records: list[CompletionRecord]) -> list[CompletionRecord]:
    """Fill in logprobs from one forward pass over the merged chain (same context as each call)."""
    filled = [CompletionRecord(r.seq, r.prompt_ids, r.sampled_ids, [0.0] * len(r.sampled_ids), r.finish_reason)
              for r in records]
    (chain,) = prefix_merging(filled).sequences
    values = trainer.logprobs([StepSequence(chain.token_ids, chain.loss_mask, chain.logprobs, 0.0)])[0].tolist()
    out, offset = [], 0
    for r in records:
        n = len(r.sampled_ids)
        out.append(CompletionRecord(r.seq, r.prompt_ids, r.sampled_ids, values[offset:offset + n], r.finish_reason))
        offset += n
    return out


def flops(config, sequences: list[StepSequence]) -> float:
    """Forward+backward FLOPs of a step (3x forward), analytic, for a Llama `config`."""
    d, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    dh = getattr(config, "head_dim", None) or d // config.num_attention_heads
    q, kv = config.num_attention_heads * dh, config.num_key_value_heads * dh
    linear = 2 * layers * (d * q + 2 * d * kv + q * d + 3 * d * config.intermediate_size)
    total = 0.0
    for s in sequences:
        t = len(s.token_ids)
        attention = 2 * 2 * layers * q * t * t / 2  # QK^T and AV, causal half
        total += linear * t + attention + 2 * d * vocab * s.trainable
    return 3 * total


def smollm2_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=2, help="episodes (sessions) in the step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    config = TrainingConfig(learning_rate=1e-6, micro_batch_tokens=args.micro_batch_tokens)

    recorder = Trainer(config, build_tiny_model(0))
    sessions = [with_rollout_logprobs(recorder, synth_session(rng)) for _ in range(args.episodes)]
    advantages = group_advantages([float(i % 2) for i in range(args.episodes)], "mean")
    calls = [len(s) for s in sessions]
    print(f"{args.episodes} episodes, calls per episode {calls}, "
          f"final context {[len(s[-1].prompt_ids) + len(s[-1].sampled_ids) for s in sessions]} tokens")

    results = {}
    for name, builder in (("per_request", per_request), ("prefix_merging", prefix_merging)):
        built = time.perf_counter()
        sequences = [StepSequence(seq.token_ids, seq.loss_mask, seq.logprobs, adv)
                     for records, adv in zip(sessions, advantages) for seq in builder(records).sequences]
        build_s = time.perf_counter() - built
        trainer = Trainer(config, build_tiny_model(0))
        started, cpu_started = time.perf_counter(), time.process_time()
        metrics = trainer.update(sequences)
        cpu_s = time.process_time() - cpu_started
        results[name] = {
            "sequences": metrics["sequences"],
            "tokens": metrics["tokens_processed"],
            "padded": metrics["padded_tokens"],
            "trainable": metrics["tokens_trained"],
            "time": time.perf_counter() - started,
            "cpu": cpu_s,
            "build": build_s,
            "gap": metrics["logprob_gap_max_abs"],
            "work_tiny": flops(tiny_config(), sequences),
            "work_smollm2": flops(smollm2_config(), sequences),
        }
        del trainer

    print(f"{'builder':<16}{'sequences':>10}{'tokens':>10}{'padded':>10}{'trainable':>10}"
          f"{'step s':>9}{'cpu s':>9}{'build s':>9}{'tok/s':>9}{'gap max':>10}")
    for name, r in results.items():
        print(f"{name:<16}{r['sequences']:>10}{r['tokens']:>10}{r['padded']:>10}{r['trainable']:>10}"
              f"{r['time']:>9.2f}{r['cpu']:>9.2f}{r['build']:>9.3f}{r['tokens'] / r['time']:>9.0f}{r['gap']:>10.2e}")
    pr, pm = results["per_request"], results["prefix_merging"]
    token_ratio = pr["tokens"] / pm["tokens"]
    time_ratio = pr["time"] / pm["time"]
    work_tiny = pr["work_tiny"] / pm["work_tiny"]
    work_smol = pr["work_smollm2"] / pm["work_smollm2"]
    print(f"token ratio (per_request / prefix_merging):      {token_ratio:6.2f}x")
    print(f"step time ratio (per_request / prefix_merging):  {time_ratio:6.2f}x")
    print(f"step CPU-time ratio (robust on a shared box):    {pr['cpu'] / pm['cpu']:6.2f}x")
    print(f"work ratio, FLOP model of this trainer, tiny:    {work_tiny:6.2f}x")
    print(f"work ratio, FLOP model, SmolLM2-135M (projected): {work_smol:6.2f}x")
    cpu_ratio = pr["cpu"] / pm["cpu"]
    for label, ratio in (("wall", time_ratio), ("CPU", cpu_ratio)):
        print(f"{label}-time ratio / token ratio = {ratio / token_ratio:.2f} (goal within 15%: "
              f"{'met' if abs(ratio / token_ratio - 1) <= 0.15 else 'not met'}); "
              f"{label}-time ratio / tiny work ratio = {ratio / work_tiny:.2f} "
              f"({'within' if abs(ratio / work_tiny - 1) <= 0.15 else 'outside'} 15%)")


if __name__ == "__main__":
    main()
