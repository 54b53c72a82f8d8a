"""The loss head: log-probabilities of sampled tokens through the LM head, chunked and fused.

    logp_i = h_i . W[t_i] - logsumexp_v(h_i . W[v])        h: [N, d], W: [V, d], t: [N]

`fused_token_logprobs` computes this over N sampled positions without ever holding the
[N, V] logits: the forward pass computes `chunk` positions at a time and keeps only the
per-position log-normaliser (lse, [N] fp32); the backward pass recomputes each chunk's logits
once and turns them in place into the logit gradient

    d logp_i / d logits_i = onehot(t_i) - softmax(logits_i)

then into the gradients of h (grad_logits @ W) and of W (grad_logits^T @ h).  With k targets
per position (a teacher's top-k tokens) the k gathers share one lse and the logit gradient is
sum_j g_ij (onehot(t_ij) - softmax(logits_i)), still one [chunk, V] buffer.  At most one
[chunk, V] fp32 buffer (plus its cast to the compute dtype under autocast) exists at a time,
in the forward and in the backward pass, whatever N is.  This is the technique of Liger
Kernel's fused linear cross-entropy (Hsu et al. 2024, arXiv:2410.10989, section 3.2) and of
Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models"
(arXiv:2411.09009), here in plain torch so it runs on CPU and CUDA alike.

Work: the head's matmul runs 4 times per sampled position (forward, recompute, grad h,
grad W) against 3 for a head that keeps its logits; grad W is skipped when W is frozen
(LoRA), so it runs 3 times there.
"""
from __future__ import annotations

import torch

from app.engines.transform import kept_threshold

# Logits per chunk, in elements (positions x vocab): 2^26 fp32 = 256 MiB, i.e. 1365 positions
# of a 49152-token vocabulary, 441 of Qwen3's 151936.
CHUNK_ELEMENTS = 2**26


def chunk_positions(vocab: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Positions per chunk so that one chunk's logits hold about `elements` values (>= 1)."""
    return max(1, elements // max(int(vocab), 1))


def _compute_dtype(tensor: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of `tensor` runs in here: the autocast dtype where autocast is on."""
    kind = tensor.device.type
    if kind in ("cuda", "cpu") and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return tensor.dtype


class _FusedHeadLogprobs(torch.autograd.Function):
    """Autograd function behind `fused_token_logprobs` (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk: int, temperature=None, support=None, top_k=None, top_p=None,
                rest_from: int | None = None):
        dtype = _compute_dtype(hidden)
        transformed = temperature is not None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            out = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
            lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
            rest = torch.zeros_like(lse)  # log of the mass outside targets[:, rest_from:] (rest_from given)
            thr = torch.empty_like(lse) if transformed else None
            for start in range(0, hidden.shape[0], chunk):
                stop = start + chunk
                t = targets[start:stop]  # [n, k]: several targets per position share one lse
                logits = (hidden[start:stop].to(dtype) @ w.T).float()
                if transformed:  # scores s = logits / T over the kept support (module docstring)
                    logits.div_(temperature[start:stop].unsqueeze(-1))
                    thr[start:stop] = kept_threshold(logits, t[:, 0], support[start:stop],
                                                     None if top_k is None else top_k[start:stop],
                                                     None if top_p is None else top_p[start:stop])
                    logits.masked_fill_(_outside(logits, t[:, 0], thr[start:stop]), float("-inf"))
                lse[start:stop] = torch.logsumexp(logits, dim=-1)
                out[start:stop] = logits.gather(-1, t) - lse[start:stop].unsqueeze(-1)
                if rest_from is not None:  # logsumexp over the columns outside the set, minus lse
                    logits.scatter_(-1, t[:, rest_from:], float("-inf"))
                    rest[start:stop] = torch.logsumexp(logits, dim=-1) - lse[start:stop]
                del logits
        ctx.save_for_backward(hidden, weight, targets, lse, temperature if transformed else None, thr, rest)
        ctx.chunk, ctx.dtype, ctx.rest_from = chunk, dtype, rest_from
        if rest_from is None:
            ctx.mark_non_differentiable(rest)
        return out, rest

    @staticmethod
    def backward(ctx, grad_out, grad_rest):
        hidden, weight, targets, lse, temperature, thr, rest = ctx.saved_tensors
        chunk, dtype, rest_from = ctx.chunk, ctx.dtype, ctx.rest_from
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            g = grad_out.float()  # [N, k]
            if temperature is not None:  # d logq / d logits = (onehot - q on the support) / T
                g = g / temperature.float().unsqueeze(-1)
            g_total = g.sum(-1)  # each of a row's targets takes its g times softmax off the row
            if rest_from is not None:
                # d log r / d logits = 1[v outside K] softmax / r - softmax: the row loses g_rest times
                # softmax too, and the columns outside K gain g_rest * softmax / r (<= g_rest each;
                # 1/r is capped at 1e30 so a vanishing r never makes inf * 0)
                g_rest = grad_rest.float()
                g_total = g_total + g_rest
                outside_gain = g_rest * torch.exp(-rest).clamp(max=1e30)
            for start in range(0, hidden.shape[0], chunk):
                stop = start + chunk
                h = hidden[start:stop].to(dtype)
                logits = (h @ w.T).float()
                if temperature is not None:
                    logits.div_(temperature[start:stop].unsqueeze(-1))
                    outside = _outside(logits, targets[start:stop, 0], thr[start:stop])
                # logits -> -sum_j g_j * softmax (in place), then + g_j at target j:
                # sum_j g_j * (onehot(t_j) - softmax)
                if rest_from is None:
                    grad_logits = logits.sub_(lse[start:stop].unsqueeze(-1)).exp_().mul_(
                        -g_total[start:stop].unsqueeze(-1))
                else:  # every column as if outside K, then K's columns set to -g_total * softmax
                    soft = logits.sub_(lse[start:stop].unsqueeze(-1)).exp_()
                    inside = targets[start:stop, rest_from:]
                    at_inside = soft.gather(-1, inside) * -g_total[start:stop].unsqueeze(-1)
                    grad_logits = soft.mul_((outside_gain[start:stop] - g_total[start:stop]).unsqueeze(-1))
                    grad_logits.scatter_(-1, inside, at_inside)
                if temperature is not None:
                    grad_logits.masked_fill_(outside, 0.0)
                grad_logits.scatter_add_(-1, targets[start:stop], g[start:stop])
                grad_logits = grad_logits.to(dtype)
                if want_h:
                    grad_h[start:stop] = (grad_logits @ w).to(hidden.dtype)
                if want_w:
                    grad_w += grad_logits.T @ h  # in the compute dtype, summed over chunks in fp32
                del logits, grad_logits
        return grad_h, (grad_w.to(weight.dtype) if want_w else None), None, None, None, None, None, None, None


def _outside(scores: torch.Tensor, targets: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """bool [n, V]: the tokens outside each row's kept support (below `thr`, the target kept)."""
    outside = scores < thr.unsqueeze(-1)
    return outside.scatter_(-1, targets.unsqueeze(-1), False)


def fused_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         chunk: int | None = None, temperature: torch.Tensor | None = None,
                         support: torch.Tensor | None = None, top_k: torch.Tensor | None = None,
                         top_p: torch.Tensor | None = None, rest_from: int | None = None):
    """log softmax(hidden @ weight.T)[targets], float32 [N], without materialising [N, V] logits.

    `hidden`: float [N, d] (the model's final hidden states at the sampled positions);
    `weight`: float [V, d] (the LM head, bias-free as in Llama/Qwen); `targets`: int64 [N] in
    [0, V), or int64 [N, k] for k tokens per position scored against one normaliser (the result
    is then float32 [N, k]; a distillation teacher's top-k tokens, `app.training.opd`).
    `chunk`: positions per chunk (default `chunk_positions(V)`).  Under autocast the matmuls
    run in the autocast dtype and the softmax in fp32.  Differentiable in `hidden` and
    `weight`.  Raises ValueError on mismatched shapes.

    With `temperature` (float [N]) the targets are scored under the sampling transform
    (`app.engines.transform.processed_logprobs`, `support`/`top_k`/`top_p` [N] as there):
    logits / T renormalised over the kept support, found per row as a threshold
    (`kept_threshold`), so the backward pass rebuilds the support from the recomputed logits
    without storing an [N, V] mask; its gradient is (onehot - q on the support) / T.  The
    transform takes [N] targets only (ValueError for [N, k]).

    With `rest_from` j ([N, k] targets, no transform) the result is the pair (float32 [N, k],
    float32 [N]): the second is log r_i, r_i = the softmax mass outside targets[i, j:] (a
    distillation teacher's top-k, whose KL's "rest" bucket needs it), computed from the logits
    as logsumexp over the other columns minus lse, so it stays exact when r is far below
    fp32's resolution of 1 - sum p.  Needs V larger than the set.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and head weight {tuple(weight.shape)} do not fit ([N, d], [V, d])")
    if targets.dim() not in (1, 2) or targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"targets {tuple(targets.shape)} must be [N] or [N, k] with N = {hidden.shape[0]}")
    if targets.dim() == 2 and (temperature is not None or support is not None):
        raise ValueError("several targets per position are scored without a sampling transform")
    if rest_from is not None and (targets.dim() != 2 or not 0 <= rest_from < targets.shape[1]):
        raise ValueError(f"rest_from {rest_from} needs [N, k] targets with k > rest_from")
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(targets.shape, dtype=torch.float32)
        return (empty, hidden.new_zeros(0, dtype=torch.float32)) if rest_from is not None else empty
    single = targets.dim() == 1
    if single:
        targets = targets.unsqueeze(-1)
    if temperature is None and support is not None:
        temperature = torch.ones(hidden.shape[0], device=hidden.device)
    if temperature is not None:
        temperature = temperature.to(hidden.device, torch.float32)
        support = (torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device) if support is None
                   else support.to(hidden.device))
    out, rest = _FusedHeadLogprobs.apply(hidden, weight, targets, chunk or chunk_positions(weight.shape[0]),
                                         temperature, support, top_k, top_p, rest_from)
    if rest_from is not None:
        return out, rest
    return out.squeeze(-1) if single else out
