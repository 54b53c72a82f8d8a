"""Trainer cost of `per_request` versus `prefix_merging` on the same multi-turn sessions.

    .venv/bin/python bench/prefix_merging.py [--episodes 2] [--seed 0] [--micro-batch-tokens 8192]
        [--device cpu|cuda] [--shape tiny|qwen3-1.7b|qwen3-4b] [--context 8192] [--peak-tflops X]

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

`--shape` picks the model: the tiny test model, or a Qwen3-1.7B / Qwen3-4B-shaped model
random-initialised from its config (no download; fp32 master weights, bf16 autocast on CUDA).
Per builder it also prints the peak memory of the step above the memory held before it, MiB
per processed token, and MFU = 6 * N * tokens / step time / peak FLOP/s, with N the
non-embedding parameters (Kaplan et al. 2020, arXiv:2001.08361) and the peak from
`--peak-tflops` (default 989 dense bf16 for an H100/H200, none on CPU: MFU not printed).
Peak memory: on CUDA `torch.cuda.max_memory_allocated`; on CPU the process's peak resident set
(VmHWM, reset through /proc/self/clear_refs before the step), which includes allocator slack.
Last, it prints the activation memory per token of the tiny model with and without activation
checkpointing: the memory the autograd graph holds between the forward and the backward pass
of one packed chain, measured in a fresh process (CPU: resident set size with glibc's mmap
threshold at 64 KiB, so that freed tensors leave the resident set; CUDA: memory_allocated).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
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
H100_BF16_TFLOPS = 989.0  # dense bf16 tensor-core peak of an H100/H200 SXM


def qwen3_config(shape: str):
    """Config of a Qwen3-1.7B or Qwen3-4B-shaped model (the published configs' sizes)."""
    from transformers import Qwen3Config

    sizes = {"qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                num_attention_heads=16, num_key_value_heads=8),
             "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                              num_attention_heads=32, num_key_value_heads=8)}[shape]
    return Qwen3Config(vocab_size=151936, head_dim=128, max_position_embeddings=131072, tie_word_embeddings=True,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, **sizes)


def build_model(shape: str, device: torch.device):
    """A random-initialised fp32 causal LM of `shape` on `device`, and its config."""
    if shape == "tiny":
        return build_tiny_model(0).to(device), tiny_config()
    from transformers import AutoModelForCausalLM

    config = qwen3_config(shape)
    torch.manual_seed(0)  # the same random weights for the recorder and every builder's model
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model, config


def non_embedding_parameters(model) -> int:
    embedding = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not embedding)


def _rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak(device: torch.device) -> int:
    """Reset the peak-memory counter; return the memory held now (bytes)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    return _rss_bytes()


def peak_since_reset(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return _rss_bytes("VmHWM")


def activation_probe(tokens: int, checkpointing: bool, device: torch.device) -> float:
    """Bytes per token the autograd graph holds between forward and backward (tiny model,
    one packed chain of `tokens`, its second half trainable); see the module docstring."""
    import gc

    from app.training.batching import make_micro_batches

    rng = random.Random(0)
    ids = [rng.randrange(3, 49000) for _ in range(tokens)]
    seq = StepSequence(ids, [0] * (tokens // 2) + [1] * (tokens - tokens // 2), [0.0] * tokens, 1.0)
    trainer = Trainer(TrainingConfig(activation_checkpointing=checkpointing, micro_batch_tokens=tokens),
                      build_tiny_model(0).to(device))
    (mb,) = make_micro_batches([seq], tokens, "token", packing=True)
    mb = mb.to(device)
    trainer.forward_logprobs(mb, grad=True).sum().backward()  # warm: gradient buffers exist from here on
    trainer.model.zero_grad(set_to_none=False)
    gc.collect()
    held = lambda: torch.cuda.memory_allocated() if device.type == "cuda" else _rss_bytes()  # noqa: E731
    if device.type == "cuda":
        torch.cuda.synchronize()
    before = held()
    loss = trainer.forward_logprobs(mb, grad=True).sum()
    if device.type == "cuda":
        torch.cuda.synchronize()
    graph = held() - before
    loss.backward()
    return graph / tokens


def activation_line(tokens: int, device: torch.device) -> str:
    """The activation-memory comparison, each figure from a fresh process."""
    per_token = {}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    for checkpointing in (False, True):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe-activations", str(tokens),
                              "--device", device.type] + (["--checkpointing"] if checkpointing else []),
                             capture_output=True, text=True, env=env, check=True)
        per_token[checkpointing] = json.loads(out.stdout.strip().splitlines()[-1])["bytes_per_token"]
    return (f"activation memory, tiny model, one {tokens}-token chain ({device.type}): "
            f"{per_token[False] / 1024:.1f} KiB/token without checkpointing, {per_token[True] / 1024:.1f} KiB/token "
            f"with ({per_token[False] / max(per_token[True], 1):.1f}x less)")


def synth_session(rng: random.Random) -> list[CompletionRecord]:
    """One episode: calls whose prompts extend the previous prompt + sampled ids (no logprobs yet)."""
    calls = rng.randint(20, 50)
    prompt = [IM_START] + [rng.randrange(3, 49000) for _ in range(rng.randint(400, 600))] + [IM_END, NL, IM_START]
    # "a few hundred" new tokens per call; longer contexts (--context) get proportionally more
    per_call = min(300 * max(1, CONTEXT // 8192), (CONTEXT - len(prompt) - 64) // calls)
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


def flops(config, sequences: list[StepSequence], head_passes: int = 4) -> float:
    """Forward+backward FLOPs of a step, analytic, for a Llama `config`: the body 3x its forward;
    the LM head at sampled positions 4x (the fused head, app/training/head.py, recomputes its
    logits in the backward instead of keeping them: forward, recompute, grad h, grad W;
    `head_passes` 3 counts it as a head that keeps its logits)."""
    d, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    dh = getattr(config, "head_dim", None) or d // config.num_attention_heads
    q, kv = config.num_attention_heads * dh, config.num_key_value_heads * dh
    linear = 2 * layers * (d * q + 2 * d * kv + q * d + 3 * d * config.intermediate_size)
    total = 0.0
    for s in sequences:
        t = len(s.token_ids)
        attention = 2 * 2 * layers * q * t * t / 2  # QK^T and AV, causal half
        total += 3 * (linear * t + attention) + head_passes * 2 * d * vocab * s.trainable
    return total


def long_chain_lines(shape: str, device: torch.device, lengths: list[int], micro_batch_tokens: int):
    """Yield one line per chain length: one merged chain of `length` tokens (an SWE-like
    session: 20% of its tokens sampled, the rest prompt and tool output) trained in one
    `Trainer.update` on a fresh `shape` model, with step time, peak memory above the weights and
    optimizer state, and whether it fit; out-of-memory is caught and reported, not raised."""
    model, _config = build_model(shape, device)
    config = TrainingConfig(learning_rate=1e-6, micro_batch_tokens=max(micro_batch_tokens, max(lengths)),
                            max_sequence_tokens=max(lengths) + 16)
    trainer = Trainer(config, model)
    rng = random.Random(0)
    warm = [StepSequence([rng.randrange(3, 49000) for _ in range(256)], [0] * 128 + [1] * 128, [0.0] * 256, 1.0)]
    trainer.update(warm)  # allocates the optimizer state, so the peak below is the step's own
    for length in sorted(lengths):
        ids = [rng.randrange(3, 49000) for _ in range(length)]
        turn = max(1, min(512, length // 10))
        mask = [1 if (i // turn) % 5 == 4 else 0 for i in range(length)]  # turns of <= 512 tokens, every fifth sampled
        seq = StepSequence(ids, mask, [-1.0 if m else 0.0 for m in mask], 1.0)
        base = reset_peak(device)
        started = time.perf_counter()
        try:
            metrics = trainer.update([seq])
            if device.type == "cuda":
                torch.cuda.synchronize()
        except torch.OutOfMemoryError as exc:
            trainer.optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            yield f"long chain {length:>7} tokens ({shape}, {device.type}): DID NOT FIT ({str(exc).splitlines()[0][:120]})"
            continue
        elapsed = time.perf_counter() - started
        peak = (peak_since_reset(device) - base) / 2**30
        total = peak_since_reset(device) / 2**30
        yield (f"long chain {length:>7} tokens ({shape}, {device.type}): fit, step {elapsed:.2f} s, "
               f"{metrics['tokens_trained']} trained tokens, peak {peak:.1f} GiB above weights+optimizer "
               f"({total:.1f} GiB in all), checkpointing {'on' if metrics['activation_checkpointing'] else 'off'}, "
               f"loss {metrics['loss']:.4f}")
    del trainer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()


def smollm2_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def main() -> None:
    global CONTEXT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=2, help="episodes (sessions) in the step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    parser.add_argument("--shape", default="tiny", choices=("tiny", "qwen3-1.7b", "qwen3-4b"))
    parser.add_argument("--context", type=int, default=CONTEXT, help="largest session context (tokens)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: H100/H200 bf16)")
    parser.add_argument("--activation-tokens", type=int, default=4096, help="chain length of the activation line")
    parser.add_argument("--warm", action="store_true",
                        help="time a warm step: one untimed update (the builder's first sequence) before the timed one")
    parser.add_argument("--long-chains", default="",
                        help="comma-separated chain lengths (tokens): train one merged chain of each in one step "
                             "and print step time, peak memory and whether it fit (e.g. 32768,65536)")
    parser.add_argument("--skip-builders", action="store_true", help="only the --long-chains lines")
    parser.add_argument("--builders", default="per_request,prefix_merging",
                        help="comma-separated builders to run (both for the ratios)")
    parser.add_argument("--activation-checkpointing", choices=("auto", "on", "off"), default="auto",
                        help="auto: the trainer's default (on with CUDA)")
    parser.add_argument("--probe-activations", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.probe_activations:
        print(json.dumps({"bytes_per_token": activation_probe(args.probe_activations, args.checkpointing, device)}))
        return
    CONTEXT = args.context
    if args.long_chains:
        lengths = [int(n) for n in args.long_chains.split(",") if n]
        for line in long_chain_lines(args.shape, device, lengths, args.micro_batch_tokens):
            print(line)
        if args.skip_builders:
            return
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    config = TrainingConfig(learning_rate=1e-6, micro_batch_tokens=args.micro_batch_tokens,
                            max_sequence_tokens=max(args.context + 64, 16),
                            activation_checkpointing={"auto": None, "on": True, "off": False}[args.activation_checkpointing])
    builders = [b for b in (("per_request", per_request), ("prefix_merging", prefix_merging))
                if b[0] in args.builders.split(",")]
    peak_tflops = args.peak_tflops
    if peak_tflops is None and device.type == "cuda" and any(n in torch.cuda.get_device_name() for n in ("H100", "H200")):
        peak_tflops = H100_BF16_TFLOPS

    recorder = Trainer(config, build_model(args.shape, device)[0])
    sessions = [with_rollout_logprobs(recorder, synth_session(rng)) for _ in range(args.episodes)]
    del recorder
    advantages = group_advantages([float(i % 2) for i in range(args.episodes)], "mean")
    calls = [len(s) for s in sessions]
    print(f"{args.episodes} episodes, calls per episode {calls}, "
          f"final context {[len(s[-1].prompt_ids) + len(s[-1].sampled_ids) for s in sessions]} tokens")

    results = {}
    for name, builder in builders:
        built = time.perf_counter()
        sequences = [StepSequence(seq.token_ids, seq.loss_mask, seq.logprobs, adv)
                     for records, adv in zip(sessions, advantages) for seq in builder(records).sequences]
        build_s = time.perf_counter() - built
        model, model_config = build_model(args.shape, device)
        n_params = non_embedding_parameters(model)
        trainer = Trainer(config, model)
        if args.warm:  # kernels chosen, allocator warm, optimizer state allocated
            trainer.update(sequences[:1])
        base = reset_peak(device)
        started, cpu_started = time.perf_counter(), time.process_time()
        metrics = trainer.update(sequences)
        if device.type == "cuda":
            torch.cuda.synchronize()
        cpu_s = time.process_time() - cpu_started
        peak = peak_since_reset(device) - base
        results[name] = {
            "sequences": metrics["sequences"],
            "tokens": metrics["tokens_processed"],
            "padded": metrics["padded_tokens"],
            "padding": metrics.get("padding_fraction", 0.0),
            "longest": metrics.get("longest_micro_batch_tokens", 0),
            "plan": metrics.get("checkpointing", "on" if metrics["activation_checkpointing"] else "off"),
            "trainable": metrics["tokens_trained"],
            "time": time.perf_counter() - started,
            "cpu": cpu_s,
            "build": build_s,
            "gap": metrics["logprob_gap_max_abs"],
            "peak_mib": peak / 2**20,
            "flops6n": 6 * n_params * metrics["tokens_processed"],
            "ckpt": metrics["activation_checkpointing"],
            "work_tiny": flops(tiny_config(), sequences),
            "work_tiny3": flops(tiny_config(), sequences, head_passes=3),
            "work_model": flops(model_config, sequences),
            "work_smollm2": flops(smollm2_config(), sequences),
        }
        del trainer, model
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print(f"{'builder':<16}{'sequences':>10}{'tokens':>10}{'padded':>10}{'trainable':>10}"
          f"{'step s':>9}{'cpu s':>9}{'build s':>9}{'tok/s':>9}{'gap max':>10}")
    for name, r in results.items():
        print(f"{name:<16}{r['sequences']:>10}{r['tokens']:>10}{r['padded']:>10}{r['trainable']:>10}"
              f"{r['time']:>9.2f}{r['cpu']:>9.2f}{r['build']:>9.3f}{r['tokens'] / r['time']:>9.0f}{r['gap']:>10.2e}")
    print(f"shape {args.shape} on {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}), "
          f"N = {n_params / 1e6:.1f}M non-embedding parameters, activation checkpointing "
          f"{'on' if next(iter(results.values()))['ckpt'] else 'off'}{', warm step' if args.warm else ''}")
    # MFU: 6*N*tokens (Kaplan et al.); "MFU+attn" counts the analytic work of this trainer
    # instead (linear layers, causal attention, LM head at sampled positions; no recompute).
    print(f"{'builder':<16}{'tokens':>10}{'step s':>9}{'peak MiB':>11}{'MiB/token':>11}{'MFU':>8}{'MFU+attn':>10}"
          f"{'padding':>9}{'longest':>9}  checkpointing")
    for name, r in results.items():
        mfu = f"{r['flops6n'] / r['time'] / (peak_tflops * 1e12):>8.1%}" if peak_tflops else f"{'n/a':>8}"
        mfu_attn = f"{r['work_model'] / r['time'] / (peak_tflops * 1e12):>10.1%}" if peak_tflops else f"{'n/a':>10}"
        print(f"{name:<16}{r['tokens']:>10}{r['time']:>9.2f}{r['peak_mib']:>11.1f}{r['peak_mib'] / r['tokens']:>11.4f}"
              f"{mfu}{mfu_attn}{r['padding']:>9.1%}{r['longest']:>9}  {r['plan']}")
    if len(results) < 2:
        return
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
    # On CPU the fused head's recompute costs less than its FLOPs say (the kept-logits head
    # spends as long writing and reading [N, vocab] tensors), so print the 3-pass count too.
    work_tiny3 = pr["work_tiny3"] / pm["work_tiny3"]
    print(f"work ratio, tiny, head counted 3x (logits kept):  {work_tiny3:6.2f}x "
          f"(CPU-time ratio / it = {pr['cpu'] / pm['cpu'] / work_tiny3:.2f})")
    cpu_ratio = pr["cpu"] / pm["cpu"]
    for label, ratio in (("wall", time_ratio), ("CPU", cpu_ratio)):
        print(f"{label}-time ratio / token ratio = {ratio / token_ratio:.2f} (goal within 15%: "
              f"{'met' if abs(ratio / token_ratio - 1) <= 0.15 else 'not met'}); "
              f"{label}-time ratio / tiny work ratio = {ratio / work_tiny:.2f} "
              f"({'within' if abs(ratio / work_tiny - 1) <= 0.15 else 'outside'} 15%)")
    print(activation_line(args.activation_tokens, device))


if __name__ == "__main__":
    main()
