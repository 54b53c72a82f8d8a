"""True packing: several sequences in one row with a document mask give each sequence exactly
the logprobs and gradients it has alone; a mask without the document boundaries does not."""
from __future__ import annotations

import random

import pytest
import torch

from app.engines.modeling import build_tiny_model
from app.runconfig import TrainingConfig
from app.training import packing, policy
from app.training.batching import StepSequence, make_micro_batches
from app.training.trainer import Trainer

LENGTHS = [37, 20, 64, 11, 50, 29]


def sequences(lengths, seed=0):
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        mask = [0] * (n // 3) + [1] * (n - n // 3)
        out.append(StepSequence([rng.randrange(3, 49000) for _ in range(n)], mask, [-9.0 if m else 0.0 for m in mask],
                                1.0 if i % 2 == 0 else -0.5, episode_id=i))
    return out


def run(model, batches, mask_of):
    """Per-token logprobs in step order and the gradients of sum(A * w * logp)."""
    model.zero_grad(set_to_none=True)
    values = []
    for mb in batches:
        lp = policy.token_logprobs(model, mb.input_ids, mask_of(mb), mb.rows, mb.cols, mb.targets,
                                   position_ids=mb.position_ids)
        (lp * mb.advantages * mb.weights).sum().backward()
        values.append((mb.sequence_index, lp.detach()))
    index = torch.cat([i for i, _ in values])
    logprobs = torch.cat([v for _, v in values])[torch.argsort(index, stable=True)]
    return logprobs, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def document_mask(mb):
    return packing.document_mask(mb.segment_lengths, "sdpa")


def no_boundaries(mb):
    """A broken mask: causal over the whole row, as if the packed sequences were one."""
    return packing.dense_document_mask(torch.zeros(mb.input_ids.shape[1], dtype=torch.long))


def relative_error(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in b)
    den = sum(float(b[k].pow(2).sum()) for k in b)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def reference():
    """Each sequence alone (one per micro-batch: no padding, no packing)."""
    model = build_tiny_model(seed=0).train()
    seqs = sequences(LENGTHS)
    return model, seqs, run(model, make_micro_batches(seqs, 1, "token"), lambda mb: mb.attention_mask)


def test_packed_rows_equal_each_sequence_alone(reference):
    model, seqs, (lp_alone, g_alone) = reference
    packed = make_micro_batches(seqs, 128, "token", packing=True)
    assert len(packed) < len(seqs) and all(len(mb.segment_lengths) >= 1 for mb in packed)
    assert any(len(mb.segment_lengths) > 1 for mb in packed)
    lp, g = run(model, packed, document_mask)
    assert (lp - lp_alone).abs().max() <= 1e-5
    assert relative_error(g, g_alone) <= 1e-5


def test_a_mask_without_document_boundaries_fails_the_comparison(reference):
    model, seqs, (lp_alone, g_alone) = reference
    lp, g = run(model, make_micro_batches(seqs, 128, "token", packing=True), no_boundaries)
    assert (lp - lp_alone).abs().max() > 1e-3
    assert relative_error(g, g_alone) > 1e-3


def test_trainer_packs_with_the_document_mask_and_matches_padding():
    seqs = sequences(LENGTHS, seed=3)
    metrics, weights = [], []
    for pack in (True, False):
        trainer = Trainer(TrainingConfig(learning_rate=1e-3, micro_batch_tokens=128, packing=pack, tis_cap=None),
                          build_tiny_model(seed=0))
        metrics.append(trainer.update(seqs))
        weights.append({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    packed, padded = metrics
    assert packed["padding_fraction"] == 0.0 < padded["padding_fraction"]
    assert padded["padding_fraction"] == pytest.approx(1 - padded["tokens_processed"] / padded["padded_tokens"])
    assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-6)
    assert packed["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-5)


def test_flex_block_mask_is_the_dense_document_mask():
    """The flex-attention form marks the same (query, key) pairs as the dense one (flex's CPU
    kernel has no backward and compiles for minutes, so training with it is checked on CUDA)."""
    if not packing.flex_attention_available():
        pytest.skip("this torch has no flex_attention")
    from torch.nn.attention.flex_attention import create_mask

    lengths = [5, 1, 9, 3]
    documents = packing.document_ids(lengths)
    block = packing.flex_document_mask(documents)
    dense = create_mask(block.mask_mod, None, None, sum(lengths), sum(lengths), device="cpu")
    assert torch.equal(dense, packing.dense_document_mask(documents))
    assert packing.dense_document_mask(documents)[0, 0, 6].tolist() == [False] * 6 + [True] + [False] * 11
    assert packing.position_ids(lengths)[0].tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2]
    with pytest.raises(ValueError, match="positive"):
        packing.document_ids([3, 0])
