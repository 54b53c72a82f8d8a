"""Routing replay's cost at a real model's shape: peak memory and step time, replay off vs on.

A Qwen3-30B-A3B-shaped Qwen3-MoE with random weights (``--shape qwen3-30b-a3b``; values of
https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json: 48 layers, hidden 2048,
128 experts top-8 renormalised, moe_intermediate 768, 32 query / 4 KV heads of 128, vocab
151936, untied embeddings, RoPE θ 1e6, RMSNorm ε 1e-6), cut to ``--layers`` so it fits one
GPU (623 M parameters a layer, 622 M in the untied embeddings: weights + gradients in bf16 cost
about 2.3 GiB per layer plus 2.3 GiB, before activations; fp32 logits of batch × seq × 151936).

One "engine" pass (no grad) records the routes of a ``[batch, seq]`` batch of random tokens;
then each step is a forward + backward of ``-mean(logprob)`` over the same batch, replay off
(the model's own routing) and on (``app.engines.routing.RouteReplay`` forcing the recorded
routes), measured ``--steps`` times after one warm-up.  Printed per mode: median step ms and
peak memory (``torch.cuda.max_memory_allocated`` on CUDA, reset before each mode; on CPU the
process's peak RSS, which only grows), and the routes' own size (``2 × layers × top_k`` B/token).

    .venv/bin/python bench/moe_replay_shape.py --shape qwen3-30b-a3b --layers 16 --batch 2 --seq 2048
    .venv/bin/python bench/moe_replay_shape.py --shape qwen3-30b-a3b --layers 1 --experts 16 --vocab 2048 \\
        --batch 1 --seq 32 --steps 1 --device cpu     # the CPU smoke run the tests do
"""
from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from app.engines.routing import RouteReplay, record_routes, route_shape, stack_routes  # noqa: E402

# https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (the fields that shape compute)
SHAPES = {
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
                          rope_theta=1000000.0, tie_word_embeddings=False),
}


def build_config(shape: str, layers: int | None, experts: int | None, vocab: int | None) -> Qwen3MoeConfig:
    """The named shape with ``layers`` / ``experts`` / ``vocab`` overridden when given.

    Raises:
        ValueError: unknown shape, or ``experts`` below the shape's top-k.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    fields = dict(SHAPES[shape])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    if experts is not None:
        if experts < fields["num_experts_per_tok"]:
            raise ValueError(f"--experts {experts} is below top-k {fields['num_experts_per_tok']}")
        fields["num_experts"] = experts
    if vocab is not None:
        fields["vocab_size"] = vocab
    return Qwen3MoeConfig(**fields)


def _peak(device: torch.device) -> float:
    """Peak bytes so far: CUDA allocator's peak, else the process's peak RSS (Linux: KiB)."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step(model, ids: torch.Tensor, routes: torch.Tensor | None) -> None:
    """Forward + backward of ``-mean(logprob)`` of ``ids[:, 1:]`` (routes forced when given)."""
    model.zero_grad(set_to_none=True)
    with contextlib.ExitStack() as stack:
        if routes is not None:
            stack.enter_context(RouteReplay(model)).set(routes)
        logits = model(ids).logits
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])
    (-logp.mean()).backward()


def measure(config: Qwen3MoeConfig, batch: int, seq: int, steps: int, device: torch.device,
            dtype: torch.dtype) -> dict:
    """``{"params", "route_bytes_per_token", "off"|"on": {"ms", "peak_bytes"}}``."""
    with torch.device(device):
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(config).to(dtype).train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    with torch.no_grad(), record_routes(model) as calls:
        model(ids)
    # Router rows are batch-major ([batch * seq, hidden]), so the routes are in that order too.
    routes = torch.from_numpy(stack_routes(calls)).to(device)
    layers, top_k, _ = route_shape(model)
    out: dict = {"params": sum(p.numel() for p in model.parameters()), "route_bytes_per_token": 2 * layers * top_k}
    for mode in ("off", "on"):
        forced = routes if mode == "on" else None
        step(model, ids, forced)   # warm-up (allocator, kernels)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(steps):
            _sync(device)
            start = time.perf_counter()
            step(model, ids, forced)
            _sync(device)
            times.append(time.perf_counter() - start)
        out[mode] = {"ms": 1000 * statistics.median(times), "peak_bytes": _peak(device)}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's, 48)")
    parser.add_argument("--experts", type=int, help="experts per layer (default: the shape's, 128)")
    parser.add_argument("--vocab", type=int, help="vocabulary size (default: the shape's, 151936)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: bfloat16 on CUDA, float32 on CPU")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    config = build_config(args.shape, args.layers, args.experts, args.vocab)
    result = measure(config, args.batch, args.seq, args.steps, device, dtype)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak_what = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS"
    print(f"{args.shape}: {config.num_hidden_layers} layers, {config.num_experts} experts top-"
          f"{config.num_experts_per_tok}, vocab {config.vocab_size}, {result['params'] / 1e9:.2f} B params, "
          f"{dtype}, batch {args.batch} x seq {args.seq}, {name}")
    print(f"routes: {result['route_bytes_per_token']} B/token, "
          f"{result['route_bytes_per_token'] * args.batch * args.seq / 2**20:.2f} MiB for the batch")
    print(f"{'replay':<7} {'step ms (median)':>17} {'peak GiB (' + peak_what + ')':>40}")
    for mode in ("off", "on"):
        r = result[mode]
        print(f"{mode:<7} {r['ms']:>17.1f} {r['peak_bytes'] / 2**30:>40.3f}")
    print(f"on/off: step time x{result['on']['ms'] / result['off']['ms']:.3f}, "
          f"peak memory x{result['on']['peak_bytes'] / result['off']['peak_bytes']:.3f}")


if __name__ == "__main__":
    main()
