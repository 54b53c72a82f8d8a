"""Routing replay in the trainer on the tiny Qwen3-MoE: the routes an engine recorded are the
routes the trainer's forwards run (packed and padded micro-batches, LoRA and full fine-tune,
activation checkpointing, the KL reference), malformed routes are refused naming the chain."""
from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from app.engines.modeling import build_tiny_model, load_model
from app.engines.routing import moe_routers, record_routes, route_shape, score_completion, stack_routes
from app.runconfig import TrainingConfig
from app.training.batching import StepSequence, make_micro_batches
from app.training.trainer import Trainer

LENGTHS = (23, 31)  # two chains: both fit one packed micro-batch of 64 tokens


@pytest.fixture(scope="module")
def moe():
    model, _tok = load_model("tiny-moe")
    return model


def _engine_side(engine, lengths=LENGTHS, seed=0):
    """What an engine records for each chain: ids, its logprobs of the second half (the sampled
    tokens) and its routes of every token but the last (-1 there), from one forward per chain."""
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = [rng.randrange(3, 49000) for _ in range(n)]
        prompt = n // 2
        with torch.no_grad():
            logprobs, routes = score_completion(engine, ids, prompt)
        chain = np.full((n, *routes.shape[1:]), -1, dtype=np.int16)
        chain[:-1] = routes
        mask = [0] * prompt + [1] * (n - prompt)
        lps = [0.0] * prompt + logprobs.tolist()
        out.append(StepSequence(ids, mask, lps, advantage=1.0 if i % 2 == 0 else -0.5, episode_id=i, routes=chain))
    return out


def _perturbed(model, scale=0.5, seed=1):
    """A copy of `model` whose routers' weights are moved: it routes many tokens elsewhere."""
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in moe_routers(other):
            router.weight.add_(scale * router.weight.std() * torch.randn(router.weight.shape, generator=gen))
    return other


def _config(**kw):
    return TrainingConfig(routing_replay=True, micro_batch_tokens=64, learning_rate=1e-3, **kw)


def _seen_routes(trainer, sequences):
    """Trainer logprobs of `sequences` and the routes its forwards ran, per sequence [T, layers, top_k]
    (a recorder entered after the replay hooks sees the forced ids)."""
    with record_routes(trainer.model) as calls:
        logprobs = trainer.logprobs(sequences)
    batches = make_micro_batches(sequences, trainer.config.micro_batch_tokens, "token", trainer.pad_id,
                                 trainer.packing)
    seen = torch.as_tensor(stack_routes(calls)).long()  # rows of every forward, in call order
    out, row = {}, 0
    for mb in batches:
        width = mb.input_ids.shape[1]
        rows = seen[row: row + mb.input_ids.numel()]
        row += mb.input_ids.numel()
        order = list(dict.fromkeys(mb.sequence_index.tolist()))
        if mb.segment_lengths is not None:  # packed: back to back
            start = 0
            for i, n in zip(order, mb.segment_lengths):
                out[i] = rows[start: start + n]
                start += n
        else:
            for r, i in enumerate(order):
                out[i] = rows[r * width: r * width + len(sequences[i].token_ids)]
    return logprobs, out, batches


@pytest.mark.parametrize("packing", [True, False])
def test_trainer_replays_the_engines_routes_and_matches_its_logprobs(moe, packing):
    # The engine's router weights differ from the trainer's: free routing disagrees on many tokens.
    engine = _perturbed(moe)
    sequences = _engine_side(engine)
    trainer = Trainer(_config(packing=packing), copy.deepcopy(moe))
    logprobs, seen, batches = _seen_routes(trainer, sequences)
    if packing:
        assert len(batches) == 1 and batches[0].segment_lengths == tuple(sorted(LENGTHS, reverse=True))
    for i, seq in enumerate(sequences):
        assert torch.equal(seen[i][:-1], torch.as_tensor(seq.routes[:-1]).long()), f"sequence {i}"
    tally = trainer.route_mismatch()
    assert tally["tokens_compared"] == sum(n - 1 for n in LENGTHS)  # the last rows are fillers, not compared
    assert tally["route_mismatch_fraction"] > 0.05  # the live router would have gone elsewhere
    # Without replay the same trainer routes those tokens otherwise.
    free = Trainer(TrainingConfig(micro_batch_tokens=64, packing=packing), copy.deepcopy(moe))
    _lp, free_seen, _b = _seen_routes(free, sequences)
    assert any(not torch.equal(free_seen[i][:-1], torch.as_tensor(s.routes[:-1]).long())
               for i, s in enumerate(sequences))
    del logprobs


@pytest.mark.parametrize("packing", [True, False])
def test_same_weights_replay_gives_the_engines_logprobs(moe, packing):
    sequences = _engine_side(moe)
    trainer = Trainer(_config(packing=packing), copy.deepcopy(moe))
    logprobs = trainer.logprobs(sequences)
    for i, seq in enumerate(sequences):
        expected = torch.tensor([lp for lp, m in zip(seq.logprobs, seq.loss_mask) if m])
        torch.testing.assert_close(logprobs[i], expected, atol=2e-5, rtol=0)
    assert trainer.route_mismatch()["route_mismatch_fraction"] == 0.0


@pytest.mark.parametrize("lora", [False, True])
def test_replay_step_trains_lora_and_full_weights_under_checkpointing(moe, lora):
    engine = _perturbed(moe)
    sequences = _engine_side(engine)
    trainer = Trainer(_config(lora=lora, activation_checkpointing=True, kl_coef=0.1, packing=True),
                      copy.deepcopy(moe))
    assert len(trainer.replays) == (1 if lora else 2)  # the frozen reference copy replays too
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    reference = trainer.reference if trainer.reference is not None else trainer.model
    with record_routes(trainer.model) as calls, record_routes(reference) as ref_calls:
        metrics = trainer.update(sequences)
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert metrics["activation_checkpointing"] and np.isfinite(metrics["loss"])
    assert metrics["routing_replay"]["route_mismatch_fraction"] > 0.05
    # Forward, the reference's forward (LoRA: the same modules, adapters off) and the backward's
    # recompute: every call of each router ran the recorded routes of the packed row.
    packed = torch.cat([torch.as_tensor(s.routes) for s in sorted(sequences, key=lambda s: -len(s.token_ids))]).long()
    recorded = (packed >= 0).all(dim=-1).all(dim=-1)
    for layer, layer_calls in enumerate(calls):
        assert len(layer_calls) == (3 if lora else 2)
        for ids in layer_calls + ref_calls[layer]:
            assert torch.equal(ids.long()[recorded], packed[recorded][:, layer])
    assert all(len(c) == (3 if lora else 1) for c in ref_calls)  # full fine-tune: the frozen copy's one forward


def _corrupt(sequence, how):
    routes = sequence.routes.copy()
    if how == "duplicate":
        routes[3, 0, 1] = routes[3, 0, 0]
    elif how == "out of range":
        routes[2, 1, 0] = 8
    elif how == "missing":
        routes[5] = -1
    elif how == "none":
        routes = None
    return StepSequence(sequence.token_ids, sequence.loss_mask, sequence.logprobs, sequence.advantage,
                        sequence.episode_id, routes=routes)


@pytest.mark.parametrize("how,words", [("duplicate", "duplicate expert"), ("out of range", "out of range"),
                                       ("missing", "out of range"), ("none", "routes missing")])
def test_malformed_routes_are_refused_naming_the_chain(moe, how, words):
    sequences = _engine_side(moe)
    sequences[1] = _corrupt(sequences[1], how)
    trainer = Trainer(_config(), copy.deepcopy(moe))
    with pytest.raises(ValueError, match=rf"training.routing_replay: sequence 1 \(episode 1, 31 tokens\).*{words}"):
        trainer.update(sequences)


def test_replay_on_a_dense_model_is_refused_by_name():
    with pytest.raises(ValueError, match="training.routing_replay: the policy has no mixture-of-experts layers"):
        Trainer(_config(), build_tiny_model(seed=0))
    assert route_shape(build_tiny_model(seed=0)) is None


def test_a_micro_batch_mixing_routed_and_unrouted_chains_is_refused(moe):
    sequences = _engine_side(moe)
    sequences[0] = _corrupt(sequences[0], "none")
    with pytest.raises(ValueError, match=r"episodes \[0\] have no routes"):
        make_micro_batches(sequences, 64, "token", packing=True)
