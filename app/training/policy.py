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
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

# Sampled positions whose logits are computed at once (4096 x 49152 fp32 logits = 0.8 GB).
HEAD_CHUNK = 4096
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


def add_lora(model, r: int, alpha: int, dropout: float):
    """Wrap `model` with peft LoRA adapters on the attention and MLP projections (base frozen)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(LORA_TARGETS), bias="none")
    return get_peft_model(model, config)


def is_lora(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def causal_lm(model):
    """The underlying `*ForCausalLM` (unwraps a peft model; its LoRA layers stay active)."""
    return model.get_base_model() if is_lora(model) else model


def autocast(device: torch.device):
    """bf16 autocast on CUDA; a no-op context on CPU (fp32)."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def token_logprobs(model, input_ids, attention_mask, rows, cols, targets, head_chunk: int = HEAD_CHUNK) -> torch.Tensor:
    """Log-probabilities (nats, float32 [N]) of `targets` under `model`.

    `input_ids`, `attention_mask`: int64 [B, T] right-padded rows; `rows`, `cols`: int64 [N],
    the position whose output predicts each target (the target sits at `cols + 1`);
    `targets`: int64 [N].  Only the N selected positions go through the LM head, not all
    B*T: context tokens never need logits.  The [N, vocab] logits are computed `head_chunk`
    positions at a time; with gradients on, each chunk is recomputed in the backward pass
    (activation checkpointing), so a long merged chain never holds all its logits at once.
    """
    lm = causal_lm(model)
    hidden = lm.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    selected = hidden[rows, cols]
    if selected.shape[0] <= head_chunk:
        return _head_logprobs(lm.lm_head, selected, targets)
    parts = []
    for start in range(0, selected.shape[0], head_chunk):
        h, t = selected[start : start + head_chunk], targets[start : start + head_chunk]
        if torch.is_grad_enabled():
            parts.append(checkpoint(_head_logprobs, lm.lm_head, h, t, use_reentrant=False))
        else:
            parts.append(_head_logprobs(lm.lm_head, h, t))
    return torch.cat(parts)


def _head_logprobs(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


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
