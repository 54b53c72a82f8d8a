"""Distillation teacher scoring throughput: prefill tokens/s of `app.training.teacher_scorers.score_with_model`.

Usage::

    .venv/bin/python bench/teacher_scoring.py                              # tiny, CPU, 1 thread
    .venv/bin/python bench/teacher_scoring.py --shape qwen3-4b --tokens 4096 --chains 8   # on CUDA
    .venv/bin/python bench/teacher_scoring.py --pipeline --chains 8 --arrival-s 2   # at the step vs as graded

`--shape` builds a random-init model of that architecture (no download): `tiny` (the test model),
`qwen3-1.7b` / `qwen3-4b` (the published Qwen3 shapes: layers, widths, GQA heads, 151936-token
vocabulary; bf16 on CUDA, fp32 on CPU).  Each chain is `--tokens` random ids, the second half
sampled (loss mask 1), scored in one prefill pass as the teacher worker scores a chain; the first
chain is a warm-up.  Prints tokens/s over the whole chain (prefill) and per scored token, and the
peak CUDA memory.  Scoring a student's chains with a teacher twice the student's size costs one
teacher forward per chain, no backward: compare with the trainer's step time on the same device.

`--pipeline` measures when the scores are ready for the training step: `--chains` episodes are
graded one every `--arrival-s` seconds (a step's rollouts finishing one after another), and the
teacher either scores them all once the last is graded (`at_step`, how the step scored before)
or each one as soon as it is graded (`as_graded`, `teacher.score_episode`), one scorer as the
`teacher` worker is one process.  Printed per mode: the step's wait for scores after its last
episode is graded, and the wall time from the first grade.  The rollouts themselves are only
waited for (sleep), not run: on a box where they take the same cores, scoring beside them slows
both, so the gain there is smaller than this upper bound.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

SHAPES = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128),
}


def build(shape: str, device: torch.device):
    if shape == "tiny":
        from app.engines.modeling import build_tiny_model

        return build_tiny_model(0).to(device)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=True,
                         **SHAPES[shape])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model.eval()


def pipeline(model, device, chains: int, tokens: int, arrival_s: float, vocab: int) -> dict:
    """Both modes of `--pipeline` on the same chains; seconds waited after the last grade, and in all."""
    import queue
    import threading

    from app.training.teacher_scorers import score_with_model

    rng = random.Random(1)
    mask = [0] * (tokens // 2) + [1] * (tokens - tokens // 2)
    work = [[rng.randrange(3, vocab) for _ in range(tokens)] for _ in range(chains)]
    score_with_model(model, work[0], mask, device)  # warm-up
    out = {}
    for mode in ("at_step", "as_graded"):
        graded: queue.Queue = queue.Queue()
        done = threading.Event()

        def scorer() -> None:
            pending = []
            for _ in range(chains):
                ids = graded.get()
                if mode == "as_graded":
                    score_with_model(model, ids, mask, device)
                else:
                    pending.append(ids)
            for ids in pending:  # at_step: the step starts after its last episode is graded
                score_with_model(model, ids, mask, device)
            done.set()

        thread = threading.Thread(target=scorer)
        started = time.perf_counter()
        thread.start()
        for i, ids in enumerate(work):
            time.sleep(max(0.0, started + i * arrival_s - time.perf_counter()))
            graded.put(ids)
        last_graded = time.perf_counter()
        done.wait()
        thread.join()
        end = time.perf_counter()
        out[mode] = {"wait_after_last_grade_s": round(end - last_graded, 2), "wall_s": round(end - started, 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["tiny", *SHAPES], default="tiny")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--pipeline", action="store_true", help="at-step against as-graded scoring (see above)")
    parser.add_argument("--arrival-s", type=float, default=2.0, help="--pipeline: seconds between two graded episodes")
    parser.add_argument("--model", help="score with this model spec instead of --shape ('smollm2', a folder)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    from app.training.teacher_scorers import score_with_model

    if args.model:
        from app.engines.modeling import load_model

        model = load_model(args.model)[0].to(device).eval()
    else:
        model = build(args.shape, device)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    if args.pipeline:
        print(json.dumps({"shape": args.model or args.shape, "device": str(device), "threads": args.threads,
                          "chains": args.chains, "tokens_per_chain": args.tokens, "arrival_s": args.arrival_s,
                          **pipeline(model, device, args.chains, args.tokens, args.arrival_s, vocab)}))
        return
    rng = random.Random(0)
    n = args.tokens
    mask = [0] * (n // 2) + [1] * (n - n // 2)
    times = []
    for i in range(args.chains + 1):
        ids = [rng.randrange(3, vocab) for _ in range(n)]
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        values = score_with_model(model, ids, mask, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first chain warms up kernels and allocators
            times.append(time.perf_counter() - started)
        assert all(v <= 0 for v in values)
    seconds = sum(times) / len(times)
    print(json.dumps({"shape": args.shape, "device": str(device), "threads": args.threads, "tokens_per_chain": n,
                      "scored_per_chain": sum(mask), "chains": len(times), "seconds_per_chain": round(seconds, 4),
                      "prefill_tokens_per_s": round(n / seconds, 1),
                      "scored_tokens_per_s": round(sum(mask) / seconds, 1),
                      "peak_cuda_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
                      if device.type == "cuda" else None}))


if __name__ == "__main__":
    main()
