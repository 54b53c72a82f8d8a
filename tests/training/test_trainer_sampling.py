"""A training step on tokens drawn under temperature, top-k and top-p: the step's own gap metric
(trainer vs rollout logprobs) is float noise when the transform travels with the sequences, and
nats when it is dropped; the update stays finite with every head."""
from __future__ import annotations

import math
import random

import pytest
import torch

from app.engines.embedded.sampling import SamplingParams, sample_batch
from app.engines.modeling import build_tiny_model
from app.runconfig import TrainingConfig
from app.training.batching import StepSequence
from app.training.trainer import Trainer
from app.training.trajectories import SequenceTransform

TRANSFORM = dict(temperature=0.7, top_p=0.9, top_k=20)


def drawn_sequences(model, count: int = 3, prompt: int = 12, sampled: int = 10):
    """Sequences whose sampled part is drawn by the embedded engine's sampler from `model`
    (one full forward per token, fp32), with the support it reported."""
    rng = random.Random(0)
    out = []
    for i in range(count):
        ids = [rng.randrange(3, 40000) for _ in range(prompt)]
        lps, support = [0.0] * prompt, [0] * prompt
        params = SamplingParams(**TRANSFORM, seed=i)
        for _ in range(sampled):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1:]
            token = sample_batch(logits, [params])[0]
            ids.append(token.token_id)
            lps.append(token.logprob)
            support.append(token.support)
        n = len(ids)
        mask = [0] * prompt + [1] * sampled
        transform = SequenceTransform([1.0] * prompt + [0.7] * sampled, support, [0] * prompt + [20] * sampled,
                                      [1.0] * prompt + [0.9] * sampled)
        assert len(transform.support) == n
        out.append(StepSequence(ids, mask, lps, advantage=1.0 if i % 2 == 0 else -1.0, episode_id=i,
                                transform=transform))
    return out


@pytest.mark.parametrize("packing", [True, False])
def test_step_gap_is_float_noise_under_the_transform(packing):
    model = build_tiny_model(0)
    sequences = drawn_sequences(model)
    matched = Trainer(TrainingConfig(packing=packing), build_tiny_model(0)).update(sequences)
    dropped = Trainer(TrainingConfig(packing=packing), build_tiny_model(0)).update(
        [StepSequence(s.token_ids, s.loss_mask, s.logprobs, s.advantage, s.episode_id) for s in sequences])
    print(f"step gap (packing={packing}): {matched['logprob_gap_max_abs']:.2e} with the transform, "
          f"{dropped['logprob_gap_max_abs']:.2e} without")
    assert matched["logprob_gap_max_abs"] <= 1e-5
    assert dropped["logprob_gap_max_abs"] > 1.0
    assert math.isfinite(matched["loss"]) and math.isfinite(matched["grad_norm"]) and matched["grad_norm"] > 0


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_fused_head_under_the_transform_equals_processed_logprobs_in_value_and_gradient(chunk):
    """The fused head (support as a per-row threshold, rebuilt in the backward pass) against
    autograd through `processed_logprobs` on full logits: recorded, derived and whole-vocabulary
    supports, a target outside its row's top |K| (kept), T != 1 and T = 1 mixed."""
    from app.engines.transform import processed_logprobs
    from app.training.head import fused_token_logprobs

    g = torch.Generator().manual_seed(0)
    n, d, vocab = 40, 16, 300
    hidden = torch.randn(n, d, generator=g, requires_grad=True)
    weight = (0.8 * torch.randn(vocab, d, generator=g)).requires_grad_(True)
    targets = torch.randint(0, vocab, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.5] * 10)
    support = torch.tensor([20, 0, -1, 1, 5] * 8)
    top_k = torch.tensor([20, 0, 20, 20, 0] * 8)
    top_p = torch.tensor([0.9, 1.0, 0.9, 1.0, 0.5] * 8)
    ref = processed_logprobs(hidden @ weight.T, targets, temperature, support, top_k, top_p)
    gh, gw = torch.autograd.grad((ref * upstream).sum(), (hidden, weight))
    out = fused_token_logprobs(hidden, weight, targets, chunk, temperature, support, top_k, top_p)
    fh, fw = torch.autograd.grad((out * upstream).sum(), (hidden, weight))
    assert (out - ref).abs().max() <= 1e-5
    assert (fh - gh).norm() / gh.norm() <= 1e-5
    assert (fw - gw).norm() / gw.norm() <= 1e-5
    plain = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[:, None])[:, 0]
    assert (out - plain).abs().max() > 0.1   # the transform changed the values: the check can fail
