"""A memory model of one training micro-batch, and the checkpointing it picks per step.

Activation memory of a Llama/Qwen decoder (hidden d, q = heads x head_dim, kv = kv_heads x
head_dim, MLP width i, L layers) per token of a micro-batch, counting the tensors autograd
keeps for the backward pass (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", arXiv:2205.05198, section 4, adapted to RMSNorm, GQA, SwiGLU and
an attention kernel that keeps only its inputs, output and log-sum-exp):

    per layer, stored       2 norms x (input + output) d  +  q, k before RoPE (q + kv)
                            + q, k, v after RoPE (q + 2 kv) + attention output q
                            + SwiGLU gate, up, act(gate), act(gate) * up (4 i)
                          = 4 d + 3 q + 3 kv + 4 i values
    per layer, checkpointed the layer's input, d values
    besides the layers      embedding output, final norm input/output: 3 d values; while a
                            checkpointed layer's backward runs, that layer's full set once
                            more; the LM head's chunk of logits (chunk x vocab fp32, twice);
                            a dense packed/padded mask: B x T x T bools

Values are 4 bytes in fp32 (the CPU trainer) and 2 bytes for matmul outputs under bf16
autocast with a 4-byte residual stream (the d-sized values).  The model is an estimate: it
ignores allocator slack and kernel workspaces; `bench/memory_model.py` prints it next to the
measured peak of the same micro-batch, and a test holds it within a factor of two at the tiny
shape on CPU.

`plan_checkpointing` picks, for a micro-batch of `tokens`, the cheapest scheme that fits a
budget: none, selective (the fewest recomputed layers that fit, spread evenly: every
L/c-th layer), or full.
Recomputing c of L layers costs c/L of one more forward pass of the body.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """The sizes the model needs (from a transformers config: `Shape.of(config)`)."""

    hidden: int
    q: int
    kv: int
    intermediate: int
    layers: int
    vocab: int

    @classmethod
    def of(cls, config) -> "Shape":
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.hidden_size, heads * head_dim, kv_heads * head_dim, config.intermediate_size,
                   config.num_hidden_layers, config.vocab_size)


@dataclass(frozen=True)
class Plan:
    """Checkpointing of one step: `layers` are recomputed in the backward pass (indices)."""

    mode: str  # "none" | "selective" | "full"
    layers: tuple[int, ...]
    every: int  # about every k-th layer recomputed (L // count; 0 for none)
    predicted_bytes: int  # activation peak of the step's largest micro-batch under this plan


def layer_bytes(shape: Shape, act_bytes: int, resid_bytes: int) -> int:
    """Bytes per token one non-checkpointed decoder layer keeps for the backward pass."""
    return 4 * shape.hidden * resid_bytes + (3 * shape.q + 3 * shape.kv + 4 * shape.intermediate) * act_bytes


def activation_bytes(shape: Shape, tokens: int, checkpointed: int, *, act_bytes: int = 4, resid_bytes: int = 4,
                     head_chunk: int = 0, dense_mask: int = 0) -> int:
    """Predicted activation peak (bytes) of one micro-batch of `tokens` (rows x width, padding
    included) with `checkpointed` of the layers recomputed; `head_chunk` positions of logits
    in flight; `dense_mask` the bool elements of a dense attention mask (B x T x T, 0 for none)."""
    if not 0 <= checkpointed <= shape.layers:
        raise ValueError(f"checkpointed layers must be within 0..{shape.layers}, got {checkpointed}")
    full = layer_bytes(shape, act_bytes, resid_bytes)
    stored = (shape.layers - checkpointed) * full + checkpointed * shape.hidden * resid_bytes
    recompute = full if checkpointed else 0
    body = tokens * (stored + recompute + 3 * shape.hidden * resid_bytes)
    return int(body + 2 * head_chunk * shape.vocab * 4 + dense_mask)


def spread(layers: int, count: int) -> tuple[int, ...]:
    """`count` of `layers` layer indices spread evenly (every L/count-th layer, from layer 0)."""
    return tuple(sorted({(j * layers) // count for j in range(count)}))


def plan_checkpointing(shape: Shape, tokens: int, budget_bytes: float, **kwargs) -> Plan:
    """The cheapest checkpointing whose predicted peak for `tokens` fits `budget_bytes`.

    Tries none, then c = 1, 2, ..., L-1 recomputed layers spread evenly (`spread`: every
    L/c-th layer), then full; when not even full fits, full (the step may then run out of
    memory, which the caller reports).  `kwargs` go to `activation_bytes`.
    """
    none = activation_bytes(shape, tokens, 0, **kwargs)
    if none <= budget_bytes:
        return Plan("none", (), 0, none)
    for count in range(1, shape.layers):
        predicted = activation_bytes(shape, tokens, count, **kwargs)
        if predicted <= budget_bytes:
            return Plan("selective", spread(shape.layers, count), shape.layers // count, predicted)
    return Plan("full", tuple(range(shape.layers)), 1, activation_bytes(shape, tokens, shape.layers, **kwargs))


def fixed_plan(shape: Shape, tokens: int, enabled: bool, **kwargs) -> Plan:
    """The plan of a fixed setting (`activation_checkpointing` true: full, false: none)."""
    layers = tuple(range(shape.layers)) if enabled else ()
    return Plan("full" if enabled else "none", layers, 1 if enabled else 0,
                activation_bytes(shape, tokens, len(layers), **kwargs))


def gib(value: float) -> int:
    """GiB to bytes."""
    return int(math.floor(value * 2**30))
