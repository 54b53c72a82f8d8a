"""Distillation teacher scoring throughput: prefill tokens/s of `app.training.teacher.score_with_model`.

Usage::

    .venv/bin/python bench/teacher_scoring.py                              # tiny, CPU, 1 thread
    .venv/bin/python bench/teacher_scoring.py --shape qwen3-4b --tokens 4096 --chains 8   # on CUDA

`--shape` builds a random-init model of that architecture (no download): `tiny` (the test model),
`qwen3-1.7b` / `qwen3-4b` (the published Qwen3 shapes: layers, widths, GQA heads, 151936-token
vocabulary; bf16 on CUDA, fp32 on CPU).  Each chain is `--tokens` random ids, the second half
sampled (loss mask 1), scored in one prefill pass as the teacher worker scores a chain; the first
chain is a warm-up.  Prints tokens/s over the whole chain (prefill) and per scored token, and the
peak CUDA memory.  Scoring a student's chains with a teacher twice the student's size costs one
teacher forward per chain, no backward: compare with the trainer's step time on the same device.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=["tiny", *SHAPES], default="tiny")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chains", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    from app.training.teacher import score_with_model

    model = build(args.shape, device)
    vocab = int(model.get_input_embeddings().weight.shape[0])
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
