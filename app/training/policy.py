"""The policy model as the trainer holds it: loading, LoRA, logprobs of sampled tokens, weights on disk.

Models come from `app.engines.modeling` (`load_model(spec, dtype)`, `save_weights`,
`load_weights_into`), the same code the engines use, so the files a checkpoint writes are the
files an engine reloads.  The trainer keeps fp32 master weights on every device; on CUDA the
forward pass runs under bf16 autocast ("bf16 on GPU, fp32 on CPU") so that small learning
rates are not rounded away as they would be in pure-bf16 weights.
"""
from __future__ import annotations

import contextlib
import copy
import sys
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from app import runconfig

# Logits computed at once by the LM head, in elements (positions x vocab): 2^28 fp32 = 1 GiB,
# i.e. 5461 positions of SmolLM2's 49152-token vocabulary, 1766 of Qwen3's 151936.
HEAD_CHUNK_ELEMENTS = 2**28
LORA_TARGETS = runconfig.LORA_TARGETS  # the attention and MLP projections of llama-style models


def load_policy(spec: str, device: torch.device):
    """Load `spec` ("tiny" | "smollm2" | checkpoint dir) as an fp32 causal LM on `device`.

    Returns `(model, vocab_size)` where `vocab_size` is the embedding's row count, the bound
    for valid token ids.  Raises whatever `app.engines.modeling.load_model` raises for a bad spec.
    """
    from app.engines import modeling

    model, _tokenizer = modeling.load_model(spec, torch.float32)
    model.to(device)
    model.train()  # llama has no dropout; LoRA dropout (if any) should act while training
    return model, int(model.get_input_embeddings().weight.shape[0])


def add_lora(model, r: int, alpha: int, dropout: float, targets=LORA_TARGETS):
    """Wrap `model` with peft LoRA adapters on the projections named in `targets` (default: every
    attention and MLP projection; base frozen)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets), bias="none")
    return get_peft_model(model, config)


def is_lora(model) -> bool:
    """Whether `model` is a peft model.  Never imports peft: a model can only be a
    `PeftModel` if peft was imported (by `add_lora`), so without LoRA peft is not needed."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def set_activation_checkpointing(model, enabled: bool) -> None:
    """Recompute each decoder layer's activations in the backward pass instead of storing them.

    Uses transformers' activation checkpointing of the decoder layers (non-reentrant
    `torch.utils.checkpoint`, which also works with frozen inputs under LoRA and inside FSDP2
    units).  It acts only while the model is in training mode and gradients are on.  Cost:
    one more forward of the body per backward (~+33% compute); gain: a layer keeps only its
    input [T, hidden] instead of every intermediate (measured with `bench/prefix_merging.py`).
    """
    lm = causal_lm(model)
    # transformers renamed gradient_checkpointing_* to activation_checkpointing_* (v5.2x); the
    # older names remain on the releases GPU images carry (5.17 seen), so use whichever exists.
    new = hasattr(lm, "activation_checkpointing_enable")
    if enabled:
        kwargs = {"use_reentrant": False}
        if new:
            lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    elif lm.is_activation_checkpointing if new else lm.is_gradient_checkpointing:
        (lm.activation_checkpointing_disable if new else lm.gradient_checkpointing_disable)()


def set_checkpointed_layers(model, layers) -> None:
    """Recompute exactly the decoder layers whose indices are in `layers` (selective
    checkpointing; empty: none).  Uses transformers' per-layer switch (`gradient_checkpointing`
    of each `GradientCheckpointingLayer`) after enabling checkpointing as a whole."""
    wanted = set(layers)
    set_activation_checkpointing(model, bool(wanted))
    if wanted:
        for i, layer in enumerate(causal_lm(model).model.layers):
            layer.gradient_checkpointing = i in wanted


def checkpointed_layers(model) -> list[int]:
    """Indices of the decoder layers recomputed in the backward pass now."""
    return [i for i, layer in enumerate(causal_lm(model).model.layers) if getattr(layer, "gradient_checkpointing", False)]


def disable_dropout(model) -> int:
    """Switch off every dropout of `model` in place, keeping its training mode; return how many.

    The engines sample with dropout off (inference), so a trainer forward with dropout on scores
    tokens under another distribution: the PPO ratio and the TIS weight would compare the
    engine's logprob with a noisy one.  Covers `torch.nn.Dropout*` modules (peft's
    `lora_dropout` among them) and attention-probability dropout, which transformers' attention
    functions read from each attention module's `attention_dropout` while it is training.
    The model stays in training mode because activation checkpointing acts only there.
    """
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            module.p = 0.0
            count += 1
        if isinstance(getattr(module, "attention_dropout", None), float) and module.attention_dropout > 0:
            module.attention_dropout = 0.0
            count += 1
    return count


def causal_lm(model):
    """The underlying `*ForCausalLM` (unwraps a peft model; its LoRA layers stay active)."""
    return model.get_base_model() if is_lora(model) else model


def autocast(device: torch.device):
    """bf16 autocast on CUDA; a no-op context on CPU (fp32)."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def token_logprobs(
    model, input_ids, attention_mask, rows, cols, targets, head_chunk: int | None = None, position_ids=None,
    head: str = "fused", temperature=None, support=None, top_k=None, top_p=None, extra_targets=None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities (nats, float32 [N]) of `targets` under `model`.

    `input_ids`: int64 [B, T]; `attention_mask`: int64 [B, T] (right-padded rows, 1 on real
    tokens), or a bool [B, 1, T, T] document mask / a flex `BlockMask` for packed rows
    (`app.training.packing.document_mask`), or None; `position_ids` int64 [B, T] or None
    (packed rows: the positions restart at 0 where each packed sequence starts; without an
    explicit mask transformers derives the block-diagonal mask from them, see
    `transformers.masking_utils.find_packed_sequence_indices`).
    `rows`, `cols`: int64 [N], the position whose output predicts each target (the target
    sits at `cols + 1`); `targets`: int64 [N].

    No KV cache is built (`use_cache=False`).  Only the N selected positions go through the LM
    head, never all B*T: context tokens need no logits, and no [T, vocab] tensor exists.
    `head` picks the loss head: "fused" (default, `app.training.head.fused_token_logprobs`:
    `head_chunk` positions at a time, no [N, vocab] logits in the forward or the backward
    pass), "checkpointed" (the earlier head: chunks of `HEAD_CHUNK_ELEMENTS` logits, each
    recomputed in the backward by `torch.utils.checkpoint`) or "plain" (all N at once, logits
    kept for the backward; the reference the others are tested against).
    logp = logit[target] - logsumexp(logits), in fp32.  Raises ValueError for another `head`.

    Sampling transform: with `temperature` (float32 [N]) and `support`, `top_k`, `top_p` ([N],
    `app.training.batching.MicroBatch`), each target is scored under the distribution the
    engine drew it from, `app.engines.transform.processed_logprobs`:
    logq = logit[target] / T - logsumexp over the |K| highest logits / T, with every head (the
    fused head finds the support per row as a threshold, `app.training.head`).

    `extra_targets` (int64 [N, k], optional): k more tokens per position, scored by the plain
    log softmax (no transform) from the same hidden states; the result is then the triple
    (float32 [N], float32 [N, k], float32 [N]), the last being log of the mass outside the k
    tokens (`app.training.head.fused_token_logprobs`' `rest_from`).  The distillation teacher's
    top-k tokens (`app.training.opd`).  Without a transform the fused head scores all 1 + k in
    one pass.  Raises ValueError for the "checkpointed" head with `extra_targets`.
    """
    lm = causal_lm(model)
    hidden = lm.model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    ).last_hidden_state
    selected = hidden[rows, cols]
    transform = None
    if temperature is not None or support is not None:
        transform = (temperature, support, top_k, top_p)
    if extra_targets is not None:
        return _with_extra_targets(lm, selected, targets, extra_targets, head, head_chunk, transform)
    if head == "fused" and lm.lm_head.bias is None:
        from app.training.head import fused_token_logprobs

        return fused_token_logprobs(selected, lm.lm_head.weight, targets, head_chunk, *(transform or ()))
    if head == "plain":
        return _head_logprobs(lm.lm_head, selected, targets, *(transform or ()))
    if head not in ("fused", "checkpointed"):
        raise ValueError(f"unknown loss head {head!r}; choose fused, checkpointed or plain")
    if head_chunk is None:
        head_chunk = max(1, HEAD_CHUNK_ELEMENTS // int(lm.lm_head.weight.shape[0]))
    parts = []
    for start in range(0, selected.shape[0], head_chunk):
        part = slice(start, start + head_chunk)
        h, t = selected[part], targets[part]
        extra = tuple(x[part] if x is not None else None for x in transform) if transform else ()
        if torch.is_grad_enabled():
            parts.append(checkpoint(_head_logprobs, lm.lm_head, h, t, *extra, use_reentrant=False))
        else:
            parts.append(_head_logprobs(lm.lm_head, h, t, *extra))
    return torch.cat(parts) if parts else selected.new_zeros(0, dtype=torch.float32)


def _with_extra_targets(lm, selected, targets, extra, head: str, head_chunk, transform):
    """(logp of `targets` [N], plain logp of `extra` [N, k], log mass outside `extra` [N]) from
    the selected hidden states."""
    if head == "fused" and lm.lm_head.bias is None:
        from app.training.head import fused_token_logprobs

        weight = lm.lm_head.weight
        if transform is None:  # one pass: the sampled token and the k extra share a normaliser
            both, rest = fused_token_logprobs(selected, weight, torch.cat([targets.unsqueeze(-1), extra], -1),
                                              head_chunk, rest_from=1)
            return both[:, 0], both[:, 1:], rest
        top, rest = fused_token_logprobs(selected, weight, extra, head_chunk, rest_from=0)
        return fused_token_logprobs(selected, weight, targets, head_chunk, *transform), top, rest
    if head not in ("fused", "plain"):
        raise ValueError(f"the {head!r} loss head does not score extra targets; use the fused or plain head")
    logits = lm.lm_head(selected).float()
    plain = torch.log_softmax(logits, dim=-1)
    sampled = _head_logprobs(lm.lm_head, selected, targets, *transform) if transform else plain.gather(
        -1, targets.unsqueeze(-1)).squeeze(-1)
    rest = torch.logsumexp(plain.scatter(-1, extra, float("-inf")), dim=-1)
    return sampled, plain.gather(-1, extra), rest


class TokenLogprobs(torch.nn.Module):
    """`token_logprobs` of the wrapped `policy` as a module: the unit whose forward the trainer
    calls, so that FSDP2 can shard it as its root (its pre-forward hook gathers the embedding,
    final norm and LM head, which `token_logprobs` uses outside the model's own forward).
    State-dict keys are the policy's with the prefix `policy.`."""

    def __init__(self, model, head: str = "fused"):
        super().__init__()
        self.policy = model
        self.head = head

    def forward(self, input_ids, attention_mask, position_ids, rows, cols, targets, temperature=None, support=None,
                top_k=None, top_p=None, extra_targets=None):
        return token_logprobs(self.policy, input_ids, attention_mask, rows, cols, targets, position_ids=position_ids,
                              head=self.head, temperature=temperature, support=support, top_k=top_k, top_p=top_p,
                              extra_targets=extra_targets)


def _head_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor, temperature=None, support=None, top_k=None,
                   top_p=None) -> torch.Tensor:
    logits = head(hidden).float()
    if temperature is not None or support is not None:
        from app.engines.transform import processed_logprobs

        return processed_logprobs(logits, targets, temperature, support, top_k, top_p)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def save_policy_weights(model, directory: Path, metadata: dict | None = None) -> None:
    """Write the full policy weights the engines load (LoRA merged in) into `directory`.

    Format: `app.engines.modeling.save_weights` (config.json + model.safetensors +
    turnstile.json with `metadata`), written atomically.  With LoRA the adapters are merged
    into a copy of the model (merging in place and unmerging would not restore the base
    weights bit for bit, so repeated saves would drift them).
    """
    from app.engines import modeling

    if is_lora(model):
        model = copy.deepcopy(model).merge_and_unload()
    modeling.save_weights(model, directory, metadata)


def load_policy_weights(model, directory: Path) -> None:
    """Load full weights written by `save_policy_weights` into a non-LoRA `model` in place."""
    from app.engines import modeling

    modeling.load_weights_into(model, directory)
