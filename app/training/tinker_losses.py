"""The Tinker SDK's built-in losses on one datum's target logprobs, as Tinker defines them.

Each loss maps the trainer's logprobs of a datum's `target_tokens` (float32 [N], with grad) and
that datum's `loss_fn_inputs` (tensors [N]) to the per-token loss [N]; a forward_backward's
loss is the plain SUM over every token of every datum (no mean: Tinker's convention, so the
gradients of two forward_backward calls add up to those of one call over both batches).
Definitions (https://tinker-docs.thinkingmachines.ai/losses):

    cross_entropy        inputs target_tokens, weights (default 1)
                         loss_t = -weights_t * logp_t
    importance_sampling  inputs target_tokens, logprobs (the sampler's, q), advantages A
                         ratio_t = exp(logp_t - q_t);  loss_t = -ratio_t * A_t
    ppo                  as importance_sampling, with the ratio clipped to
                         [clip_low_threshold, clip_high_threshold] (loss_fn_config; 0.8, 1.2)
                         loss_t = -min(ratio_t * A_t, clip(ratio_t) * A_t)

The SDK's client-side custom loss (`TrainingClient.forward_backward_custom`) needs no loss of
its own here: it runs a forward (cross_entropy) for the logprobs, differentiates the user's loss
on the client and sends the result back as cross_entropy with `weights = -dC/dlogp`, the
linear loss whose gradient is the custom loss's.
"""
from __future__ import annotations

import torch

LOSSES = ("cross_entropy", "importance_sampling", "ppo")
# loss_fn_inputs each loss reads: (required, optional)
INPUTS = {
    "cross_entropy": (("target_tokens",), ("weights",)),
    "importance_sampling": (("target_tokens", "logprobs", "advantages"), ()),
    "ppo": (("target_tokens", "logprobs", "advantages"), ()),
}
CONFIG = {"cross_entropy": (), "importance_sampling": (), "ppo": ("clip_low_threshold", "clip_high_threshold")}
PPO_CLIP = (0.8, 1.2)


class LossInputError(ValueError):
    """A forward_backward request whose loss, inputs or config do not fit (the caller's mistake)."""


def check(loss_fn: str, config: dict | None) -> dict:
    """`config` checked for `loss_fn`: a dict of floats.  Raises `LossInputError` for an
    unknown loss, an unknown config key or a non-numeric value."""
    if loss_fn not in LOSSES:
        raise LossInputError(f"loss function {loss_fn!r} is not supported here; supported: {', '.join(LOSSES)} "
                             "(forward_backward_custom runs as cross_entropy with weights)")
    config = dict(config or {})
    unknown = sorted(set(config) - set(CONFIG[loss_fn]))
    if unknown:
        raise LossInputError(f"loss_fn_config keys {unknown} are not read by {loss_fn} "
                             f"(it reads: {list(CONFIG[loss_fn]) or 'none'})")
    out = {}
    for name, value in config.items():
        try:
            out[name] = float(value)
        except (TypeError, ValueError):
            raise LossInputError(f"loss_fn_config[{name!r}] = {value!r} is not a number") from None
    if loss_fn == "ppo":
        low, high = out.get("clip_low_threshold", PPO_CLIP[0]), out.get("clip_high_threshold", PPO_CLIP[1])
        if not 0 <= low <= 1 <= high:
            raise LossInputError(f"ppo clip thresholds must satisfy 0 <= low <= 1 <= high, got {low}, {high}")
    return out


def check_inputs(loss_fn: str, inputs: dict[str, torch.Tensor], n: int, where: str) -> None:
    """Raise `LossInputError` (naming `where`, e.g. "data[3]") unless `inputs` holds exactly the
    fields `loss_fn` reads, each of `n` values."""
    required, optional = INPUTS[loss_fn]
    missing = [k for k in required if k not in inputs]
    extra = sorted(set(inputs) - set(required) - set(optional))
    if missing or extra:
        problems = ([f"missing {missing}"] if missing else []) + ([f"unexpected {extra}"] if extra else [])
        raise LossInputError(f"{where}: {loss_fn} reads loss_fn_inputs {list(required + optional)}; "
                             f"{', '.join(problems)}")
    for name, tensor in inputs.items():
        if tensor.numel() != n:
            raise LossInputError(f"{where}: loss_fn_inputs[{name!r}] has {tensor.numel()} values for {n} input tokens "
                                 "(one per position of model_input)")


def elementwise(loss_fn: str, logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """Per-token loss float32 [N] of one datum (module docstring), differentiable in `logprobs`."""
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        return -logprobs if weights is None else -weights.reshape(-1) * logprobs
    sampler = inputs["logprobs"].reshape(-1)
    advantages = inputs["advantages"].reshape(-1)
    ratio = torch.exp(logprobs - sampler)
    if loss_fn == "importance_sampling":
        return -ratio * advantages
    low = config.get("clip_low_threshold", PPO_CLIP[0])
    high = config.get("clip_high_threshold", PPO_CLIP[1])
    return -torch.minimum(ratio * advantages, torch.clamp(ratio, low, high) * advantages)
