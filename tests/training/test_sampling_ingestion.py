"""The sampling transform travels from the capture to the trainer's micro-batches, and a token
recorded outside its own support is refused at ingestion (its row kept, with the reason)."""
from __future__ import annotations

import pytest
import torch
from sqlalchemy import select

from app.db import session_scope
from app.engines.transform import processed_logprobs
from app.tables import Completion
from app.training.batching import StepSequence, make_micro_batches
from app.training.store import build_episode_trajectories, trajectory_transform
from app.training.trajectories import CompletionRecord, sequence_transform, validate_completion
from support.episodes import seed_episode

P1 = [1, 50, 51, 2, 198, 1]
TOP = {"temperature": 0.7, "top_p": 0.9, "top_k": 20}


def seed(calls) -> int:
    """An episode whose completions are `calls`: (prompt, sampled, logprobs, turnstile_sampling)."""
    return seed_episode([(prompt, sampled, lps) for prompt, sampled, lps, _ in calls],
                        extra=[{"normalized_request": {"temperature": 0.7} | ({"turnstile_sampling": sampling} if sampling else {})}
                               for *_, sampling in calls])


def test_transform_reaches_the_micro_batch_and_outside_support_is_refused(any_database):
    p2 = P1 + [60, 61, 2] + [198, 1]
    p3 = p2 + [62, 2] + [198, 1]
    episode_id = seed([
        (P1, [60, 61, 2], [-0.5, -0.25, -0.125], {**TOP, "support": [3, 1, 12], "rank": [0, 0, 4]}),
        (p2, [62, 2], [-1.0, -2.0], {**TOP, "support": [5, 2], "rank": [1, 2]}),   # rank 2 of a support of 2
        (p3, [63, 2], [-1.5, -0.75], None),                                          # the identity
    ])
    with session_scope() as s:
        rows, report = build_episode_trajectories(s, episode_id, "prefix_merging", vocab_size=49152)
        comps = s.scalars(select(Completion).where(Completion.episode_id == episode_id).order_by(Completion.seq)).all()
        assert report["rejected_reasons"] == {"sampled_outside_support": 1}
        assert [c.rejected_reason is not None for c in comps] == [False, True, False]   # the row stays
        assert "ranks 2 (0 = most likely), outside its recorded support of 2 tokens" in comps[1].rejected_reason
        (chain,) = rows
        transform = trajectory_transform(chain)
    start = len(P1)
    assert chain.meta["sampling"][1] is None and transform.support[start:start + 3] == [3, 1, 12]
    assert transform.temperature[start:start + 3] == [0.7] * 3 and transform.temperature[-2:] == [1.0, 1.0]
    assert transform.support[-2:] == [0, 0]   # the third call: the whole vocabulary, untempered
    (mb,) = make_micro_batches([StepSequence(chain.token_ids, chain.loss_mask, chain.logprobs, 1.0, episode_id,
                                             transform)], 4096, "token")
    assert mb.temperature.tolist() == pytest.approx([0.7] * 3 + [1.0] * 2)
    assert mb.support.tolist() == [3, 1, 12, 0, 0] and mb.top_k.tolist() == [20] * 3 + [0] * 2


def test_identity_chains_carry_no_transform(any_database):
    episode_id = seed([(P1, [60, 61, 2], [-0.5, -0.25, -0.125], None)])
    with session_scope() as s:
        (chain,), _ = build_episode_trajectories(s, episode_id, "prefix_merging", vocab_size=49152)
        assert "sampling" not in chain.meta and trajectory_transform(chain) is None
    (mb,) = make_micro_batches([StepSequence(chain.token_ids, chain.loss_mask, chain.logprobs, 1.0, 1)], 4096, "token")
    assert mb.transform() == {"temperature": None, "support": None, "top_k": None, "top_p": None}


@pytest.mark.parametrize("sampling, logprobs, kind", [
    ({**TOP, "support": [4, 3], "rank": [0, 3]}, [-0.1, -0.2], "sampled_outside_support"),
    ({**TOP}, [-0.1, -9999.0], "sampled_outside_support"),                  # vLLM's -inf under top-k/top-p
    ({**TOP, "support": [4], "rank": [0]}, [-0.1, -0.2], "invalid_sampling"),   # one entry short
    ({**TOP, "support": [0, 3], "rank": [0, 0]}, [-0.1, -0.2], "invalid_sampling"),
    ({**TOP, "support": [60000, 3], "rank": [0, 0]}, [-0.1, -0.2], "invalid_sampling"),
    ({**TOP, "temperature": 0.0}, [-0.1, -0.2], "invalid_sampling"),
    ({**TOP, "top_p": 1.5}, [-0.1, -0.2], "invalid_sampling"),
])
def test_bad_sampling_records_are_refused_with_their_kind(sampling, logprobs, kind):
    record = CompletionRecord(seq=0, prompt_ids=P1, sampled_ids=[60, 61], logprobs=logprobs, sampling=sampling)
    reason = validate_completion(record, vocab_size=49152)
    assert reason is not None and reason.startswith(kind + ":"), reason


def test_unreported_support_is_derived_and_mixed_spans_line_up():
    transform = sequence_transform(8, [(2, 4), (6, 8)], [{**TOP, "support": [5, None], "rank": [0, None]},
                                                          {"temperature": 1.3, "top_p": 1.0, "top_k": 0}])
    assert transform.support == [0, 0, 5, -1, 0, 0, 0, 0]
    assert transform.temperature == [1.0, 1.0, 0.7, 0.7, 1.0, 1.0, 1.3, 1.3]
    with pytest.raises(ValueError, match="2 sampling records for 1 spans"):
        sequence_transform(8, [(2, 4)], [None, TOP])


def test_processed_logprobs_is_the_renormalised_top_set_and_its_gradient_is_finite():
    torch.manual_seed(0)
    logits = (torch.randn(5, 300) * 3).requires_grad_()
    targets = torch.tensor([0, 1, 2, 3, 4])
    temperature, support = torch.tensor([0.7, 0.7, 1.0, 2.0, 0.5]), torch.tensor([20, 1, 0, 7, 1])
    value = processed_logprobs(logits, targets, temperature, support)
    for i in range(5):
        scores = logits[i].detach() / temperature[i]
        keep = torch.topk(scores, int(support[i]) or 300).indices
        if targets[i] not in keep:   # the sampled token is always kept: top |K|-1 plus it
            keep = torch.cat([keep[:-1], targets[i:i + 1]])
        expected = scores[targets[i]] - torch.logsumexp(scores[keep], -1)
        assert float(value[i].detach()) == pytest.approx(float(expected), abs=1e-6)
    value.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[1].abs().sum() == 0   # |K| = 1: logq = 0
