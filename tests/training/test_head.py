"""The fused, chunked loss head: the plain head's logprobs and gradients, without [N, vocab] logits."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from app.engines.modeling import build_tiny_model
from app.training import policy
from app.training.batching import StepSequence, make_micro_batches
from app.training.head import chunk_positions, fused_token_logprobs


class LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def inputs(n=50, d=16, vocab=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, requires_grad=True)
    weight = (0.3 * torch.randn(vocab, d, generator=g)).requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    return hidden, weight, targets, upstream


def plain(hidden, weight, targets):
    return torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


@pytest.mark.parametrize("chunk", [1, 7, 50, 64])
def test_fused_head_equals_the_plain_head_in_value_and_gradient(chunk):
    hidden, weight, targets, upstream = inputs()
    ref = plain(hidden, weight, targets)
    gh, gw = torch.autograd.grad((ref * upstream).sum(), (hidden, weight))
    out = fused_token_logprobs(hidden, weight, targets, chunk)
    fh, fw = torch.autograd.grad((out * upstream).sum(), (hidden, weight))
    assert (out - ref).abs().max() <= 1e-5
    assert (fh - gh).norm() / gh.norm() <= 1e-5
    assert (fw - gw).norm() / gw.norm() <= 1e-5


def test_fused_head_never_holds_the_logits_of_all_positions():
    hidden, weight, targets, upstream = inputs(n=64, vocab=300)
    with LargestTensor() as seen:
        out = fused_token_logprobs(hidden, weight, targets, chunk=8)
        (out * upstream).sum().backward()
    assert seen.largest == max(8 * 300, weight.numel())  # one chunk of logits, or the weight's gradient
    with LargestTensor() as seen_plain:
        (plain(hidden, weight, targets) * upstream).sum().backward()
    assert seen_plain.largest >= 64 * 300  # the check can fail: the plain head holds them all


def test_frozen_head_gets_no_gradient_and_bad_shapes_are_refused():
    hidden, weight, targets, upstream = inputs()
    weight.requires_grad_(False)
    (fused_token_logprobs(hidden, weight, targets, 9) * upstream).sum().backward()
    assert weight.grad is None and hidden.grad is not None
    with pytest.raises(ValueError, match="do not fit"):
        fused_token_logprobs(hidden, weight[:, :3], targets)
    with pytest.raises(ValueError, match="targets"):
        fused_token_logprobs(hidden, weight, targets[:3])
    assert chunk_positions(151936) == 441 and chunk_positions(10**9) == 1


def test_policy_heads_agree_on_the_tiny_model():
    model = build_tiny_model(seed=0).train()
    ids = [(31 * i) % 40000 + 3 for i in range(90)]
    seq = StepSequence(ids, [0] * 30 + [1] * 60, [0.0] * 90, 1.0)
    (mb,) = make_micro_batches([seq], 128, "token")
    results = {}
    for head in ("plain", "checkpointed", "fused"):
        model.zero_grad(set_to_none=True)
        lp = policy.token_logprobs(model, mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.targets,
                                   head_chunk=16, head=head)
        lp.sum().backward()
        results[head] = (lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    ref_lp, ref_g = results["plain"]
    for head in ("checkpointed", "fused"):
        lp, g = results[head]
        assert (lp - ref_lp).abs().max() <= 1e-5, head
        err = (sum(float((g[n] - ref_g[n]).pow(2).sum()) for n in ref_g) / sum(float(v.pow(2).sum()) for v in ref_g.values())) ** 0.5
        assert err <= 1e-5, head
    with pytest.raises(ValueError, match="loss head"):
        policy.token_logprobs(model, mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.targets, head="other")
