"""GRPO math and the trainer's update on the tiny model (real forward/backward, CPU fp32)."""
from __future__ import annotations

import math

import pytest
import torch

from app.engines.modeling import build_tiny_model
from app.training.batching import StepSequence, aggregation_weights, make_micro_batches
from app.runconfig import TrainingConfig
from app.training.grpo import group_advantages, policy_loss
from app.training.trainer import Trainer
from app.training.trajectories import CompletionRecord, per_request, prefix_merging


# --- advantages ------------------------------------------------------------------------


def test_group_advantages_mean_and_leave_one_out():
    rewards = [1.0, 0.0, 0.0, 1.0]
    std = math.sqrt(1 / 3)  # sample std of [1, 0, 0, 1]
    assert group_advantages(rewards, "mean", normalize_std=False) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages(rewards, "mean") == pytest.approx([0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std], rel=1e-5)
    # Leave-one-out: 1 - mean(0, 0, 1) = 2/3; 0 - mean(1, 0, 1) = -2/3.
    assert group_advantages(rewards, "leave_one_out", normalize_std=False) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_group_advantages_equal_rewards_and_failed_episodes_give_exact_zero():
    assert group_advantages([0.3, 0.3, 0.3], "mean") == [0.0, 0.0, 0.0]
    assert group_advantages([1.0, 1.0, 1.0, 1.0], "leave_one_out") == [0.0, 0.0, 0.0, 0.0]
    # A failed episode (no reward) gets 0 and stays out of the baseline.
    assert group_advantages([1.0, None, 0.0], "mean", normalize_std=False) == [0.5, 0.0, -0.5]
    assert group_advantages([1.0, float("nan")], "mean") == [0.0, 0.0]  # one valid reward: no baseline
    with pytest.raises(ValueError, match="unknown advantage mode"):
        group_advantages([1.0, 0.0], "median")


# --- loss -------------------------------------------------------------------------------


def test_policy_loss_clip_higher_tis_cap_and_k3():
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0], requires_grad=True)
    # ratio = exp(logp - old): 1.5 (above 1+0.28), 0.5 (below 1-0.2), 1.1, 1.0
    old = logp.detach() - torch.log(torch.tensor([1.5, 0.5, 1.1, 1.0]))
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    rollout = old - torch.log(torch.tensor([1.0, 1.0, 1.0, 3.0]))  # TIS raw weight 3 on the last token
    weights = torch.full((4,), 0.25)
    loss, stats = policy_loss(logp, old, rollout, adv, weights, clip_low=0.2, clip_high=0.28, tis_cap=2.0)
    loss.backward()
    assert stats.clipped == 2 and stats.tis_truncated == 1
    # Clipped tokens carry no gradient; the others get -w * tis * A * ratio.
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -0.25 * 1.1, 0.25 * 2.0 * 1.0])
    # k3 KL is exactly zero where the policy equals the reference, positive elsewhere.
    ref = torch.tensor([-1.0, -1.0, -2.0, -0.5])
    _, kl_stats = policy_loss(logp.detach(), old, rollout, adv, weights, clip_low=0.2, clip_high=0.28,
                              tis_cap=None, ref_logprobs=ref, kl_coef=0.1)
    expected = sum(math.exp(d) - d - 1 for d in (0.0, 0.0, -1.0, 0.5))
    assert kl_stats.kl == pytest.approx(expected, rel=1e-6)


# A 4-way categorical policy softmax(theta) against the reference softmax(ref_logits), advantage 0,
# kl_coef 1: the expected gradient of each estimator used as a loss (samples held fixed, each
# outcome weighted by its detached policy probability).
KL_THETA = [0.5, -0.3, 0.1, 1.2]
KL_REF_LOGITS = [0.0, 0.8, -0.5, 0.3]
FORWARD_KL_GRAD = [0.0490, -0.3208, 0.0451, 0.2267]   # grad KL(ref || policy)
REVERSE_KL_GRAD = [-0.0090, -0.1780, 0.0102, 0.1768]  # grad KL(policy || ref)


def _expected_kl_gradient(estimator: str) -> list[float]:
    theta = torch.tensor(KL_THETA, requires_grad=True)
    logp = torch.log_softmax(theta, dim=0)
    ref = torch.log_softmax(torch.tensor(KL_REF_LOGITS), dim=0)
    zeros = torch.zeros(4)
    loss, stats = policy_loss(logp, logp.detach(), logp.detach(), zeros, logp.exp().detach(), clip_low=0.2,
                              clip_high=0.28, tis_cap=None, ref_logprobs=ref, kl_coef=1.0, kl_estimator=estimator)
    loss.backward()
    # The reported KL is k3's value whichever estimator is in the loss.
    delta = ref - logp.detach()
    assert stats.kl == pytest.approx(float((torch.exp(delta) - delta - 1).sum()), rel=1e-6)
    return theta.grad.tolist()


def test_kl_estimators_gradients_on_a_categorical():
    # The closed forms of both KLs, by autograd on the exact expectations.
    q = torch.softmax(torch.tensor(KL_REF_LOGITS), 0)
    for kl, expected in ((lambda p: (q * (q.log() - p.log())).sum(), FORWARD_KL_GRAD),
                         (lambda p: (p * (p.log() - q.log())).sum(), REVERSE_KL_GRAD)):
        theta = torch.tensor(KL_THETA, requires_grad=True)
        kl(torch.softmax(theta, 0)).backward()
        assert theta.grad.tolist() == pytest.approx(expected, abs=1e-4)
    # k3 as a loss follows the forward KL (the default, kept); k2 follows the reverse KL.
    assert _expected_kl_gradient("k3") == pytest.approx(FORWARD_KL_GRAD, abs=1e-4)
    assert _expected_kl_gradient("k2") == pytest.approx(REVERSE_KL_GRAD, abs=1e-4)
    with pytest.raises(ValueError, match="unknown KL estimator 'k1'"):
        _expected_kl_gradient("k1")


def test_kl_estimator_is_a_validated_training_option():
    assert TrainingConfig().kl_estimator == "k3"
    assert TrainingConfig(kl_estimator="k2").kl_estimator == "k2"
    with pytest.raises(ValueError, match="kl_estimator"):
        TrainingConfig(kl_estimator="k1")


def test_aggregation_weights_token_and_sequence():
    assert aggregation_weights([2, 3], "token", step_tokens=10, step_episodes=4) == [0.1] * 5
    assert aggregation_weights([2, 4], "sequence", step_tokens=10, step_episodes=2) == pytest.approx([0.25] * 2 + [0.125] * 4)
    # Two chains of one episode (2 + 4 trainable tokens) share the episode's mean.
    assert aggregation_weights([2, 4], "sequence", 6, 1, episode_lengths=[6, 6]) == pytest.approx([1 / 6] * 6)


def chains(lengths, episode_id, advantage):
    """Chains of one episode: each of `lengths` tokens, its second half trainable."""
    out = []
    for n in lengths:
        ids = [(7 * i + n) % 4000 + 3 for i in range(n)]
        mask = [0] * (n // 2) + [1] * (n - n // 2)
        out.append(StepSequence(ids, mask, [-5.0 if m else 0.0 for m in mask], advantage, episode_id=episode_id))
    return out


def test_sequence_aggregation_weighs_each_episode_once_however_many_chains():
    """Episode 0 as one chain, then the same tokens split into 2 chains (as prefix merging does
    after a turn that does not extend the previous one): each episode's tokens weigh 1/E in all,
    and the step's loss is the same either way."""
    whole = chains([40], 0, 1.0)
    ids, mask, lps = whole[0].token_ids, whole[0].loss_mask, whole[0].logprobs
    split = [StepSequence(ids[:24], mask[:24], lps[:24], 1.0, episode_id=0),
             StepSequence(ids[:20] + ids[24:], mask[:20] + mask[24:], lps[:20] + lps[24:], 1.0, episode_id=0)]
    other = chains([30], 1, 0.5)
    for parts in (whole, split):
        batches = make_micro_batches(parts + other, 256, "sequence")
        per_episode = {0: 0.0, 1: 0.0}
        for mb in batches:
            for w, i in zip(mb.weights.tolist(), mb.sequence_index.tolist()):
                per_episode[(parts + other)[i].episode_id] += w
        assert per_episode == pytest.approx({0: 0.5, 1: 0.5})
    # Without TIS the first update's loss is -sum(weight x advantage): -(0.5 x 1 + 0.5 x 0.5)
    # when each episode weighs once (a weight per chain would give -(2/3 + 1/6)).
    losses = []
    for parts in (whole, split):
        trainer = Trainer(TrainingConfig(loss_aggregation="sequence", tis_cap=None), build_tiny_model(seed=0))
        losses.append(trainer.update(parts + other)["loss"])
    assert losses == pytest.approx([-0.75, -0.75], rel=1e-5)


def test_micro_batches_respect_budget_and_weights_sum_to_one():
    seqs = [StepSequence([5] * n, [0] * (n - 2) + [1, 1], [0.0] * (n - 2) + [-1.0, -2.0], 1.0) for n in (40, 30, 20, 10, 5)]
    batches = make_micro_batches(seqs, micro_batch_tokens=64, aggregation="sequence")
    assert [mb.input_ids.shape for mb in batches] == [torch.Size([1, 40]), torch.Size([2, 30]), torch.Size([2, 10])]
    assert all(mb.padded_tokens <= 64 for mb in batches)
    assert float(sum(mb.weights.sum() for mb in batches)) == pytest.approx(1.0)
    assert sum(mb.tokens for mb in batches) == 105
    assert batches[0].targets.tolist() == [5, 5] and batches[0].rollout_logprobs.tolist() == [-1.0, -2.0]


# --- the trainer on the tiny model ------------------------------------------------------


def rollout(model, prompt: list[int], n: int, seed: int) -> tuple[list[int], list[float]]:
    """Sample n tokens from `model` and record their logprobs with a plain full forward pass."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)))
        logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    sampled = ids[len(prompt):]
    lps = [float(logp[len(prompt) + i - 1, t]) for i, t in enumerate(sampled)]
    return sampled, lps


def make_sequence(model, prompt, n, seed, advantage):
    sampled, lps = rollout(model, prompt, n, seed)
    return StepSequence(prompt + sampled, [0] * len(prompt) + [1] * n, [0.0] * len(prompt) + lps, advantage)


def sequence_logprob(trainer, seq) -> float:
    return float(trainer.logprobs([seq])[0].sum())


def test_positive_advantage_raises_rewarded_tokens_and_lowers_penalized():
    model = build_tiny_model(seed=0)
    prompt = [1, 1000, 2000, 3000, 2, 1]
    good = make_sequence(model, prompt, 8, seed=1, advantage=0.0)
    bad = make_sequence(model, prompt, 8, seed=2, advantage=0.0)
    assert good.token_ids != bad.token_ids
    adv = group_advantages([1.0, 0.0], "mean")
    good.advantage, bad.advantage = adv
    trainer = Trainer(TrainingConfig(learning_rate=1e-3), model)
    before = sequence_logprob(trainer, good), sequence_logprob(trainer, bad)
    metrics = trainer.update([good, bad])
    after = sequence_logprob(trainer, good), sequence_logprob(trainer, bad)
    assert after[0] > before[0] + 0.05, (before, after)
    assert after[1] < before[1] - 0.05, (before, after)
    assert metrics["tokens_trained"] == 16 and metrics["sequences"] == 2 and metrics["optimizer_updates"] == 1
    assert metrics["micro_batches_zero_advantage"] == 0
    # Before the first update the trainer reproduces the recorded rollout logprobs.
    assert metrics["logprob_gap_max_abs"] < 1e-4 and metrics["logprob_gap_mean_abs"] < 1e-5


def test_equal_rewards_leave_weights_unchanged():
    model = build_tiny_model(seed=0)
    prompt = [1, 1000, 2000, 2, 1]
    seqs = [make_sequence(model, prompt, 6, seed=s, advantage=0.0) for s in range(3)]
    for seq, adv in zip(seqs, group_advantages([1.0, 1.0, 1.0], "mean")):
        seq.advantage = adv
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(TrainingConfig(learning_rate=1e-2), model)
    metrics = trainer.update(seqs)
    drift = max(float((model.state_dict()[k] - v).abs().max()) for k, v in before.items())
    assert drift < 1e-7 and metrics["loss"] == 0.0 and metrics["grad_norm"] == 0.0
    # zero advantage: no backward pass at all, but the trainer-vs-rollout gap is still measured
    assert metrics["micro_batches_zero_advantage"] == metrics["micro_batches"] >= 1
    assert metrics["logprob_gap_max_abs"] < 1e-4


def test_the_logprob_gap_of_stale_sequences_is_reported_apart_from_the_on_policy_gap():
    """A sequence sampled by older weights differs from the trainer by the policy's change as well
    as by any sampling mismatch; mixing it in would hide a fidelity fault behind staleness (or
    show staleness as one).  Here its recorded logprobs are shifted by 0.5 nats."""
    model = build_tiny_model(seed=0)
    prompt = [1, 1000, 2000, 3000, 2, 1]
    fresh = make_sequence(model, prompt, 6, seed=1, advantage=1.0)
    stale = make_sequence(model, prompt, 5, seed=2, advantage=-1.0)
    stale.logprobs = [lp - 0.5 if m else lp for lp, m in zip(stale.logprobs, stale.loss_mask)]
    stale.policy_lag = 1
    metrics = Trainer(TrainingConfig(learning_rate=1e-3), model).update([fresh, stale])
    assert metrics["logprob_gap_max_abs"] < 1e-4 and metrics["logprob_gap_mean_abs"] < 1e-5
    assert abs(metrics["logprob_gap_stale_max_abs"] - 0.5) < 1e-4
    assert abs(metrics["logprob_gap_stale_mean_abs"] - 0.5) < 1e-4 and metrics["tokens_stale"] == 5
    # a step of stale chains only has no on-policy gap: None, not a perfect 0
    only_stale = Trainer(TrainingConfig(learning_rate=1e-3), build_tiny_model(seed=0)).update([stale])
    assert only_stale["logprob_gap_max_abs"] is None and only_stale["logprob_gap_mean_abs"] is None
    assert abs(only_stale["logprob_gap_stale_max_abs"] - 0.5) < 1e-4


def test_merged_chain_reproduces_per_request_logprobs():
    """Token-exact merging: a chain's sampled tokens see exactly their per-request context."""
    model = build_tiny_model(seed=0)
    trainer = Trainer(TrainingConfig(), model)
    prompt = [1, 500, 600, 2, 1]
    records = []
    for turn in range(4):
        sampled, lps = rollout(model, prompt, 5, seed=turn)
        records.append(CompletionRecord(seq=turn, prompt_ids=list(prompt), sampled_ids=sampled, logprobs=lps))
        prompt = prompt + sampled + [2, 1, 700 + turn, 701, 2, 1]  # tool result between calls
    merged = prefix_merging(records).sequences
    singles = per_request(records).sequences
    assert len(merged) == 1 and len(singles) == 4
    def as_step(s):
        return StepSequence(s.token_ids, s.loss_mask, s.logprobs, 1.0)
    chain_lp = trainer.logprobs([as_step(merged[0])])[0]
    single_lp = torch.cat(trainer.logprobs([as_step(s) for s in singles]))
    assert torch.allclose(chain_lp, single_lp, atol=1e-5)
    recorded = torch.tensor([lp for r in records for lp in r.logprobs])
    assert torch.allclose(chain_lp, recorded, atol=1e-4)


def test_several_updates_per_step_use_pre_update_logprobs_and_clip():
    model = build_tiny_model(seed=0)
    prompt = [1, 42, 43, 2, 1]
    seqs = [make_sequence(model, prompt, 6, seed=s, advantage=a) for s, a in ((0, 1.0), (1, -1.0), (2, 1.0))]
    config = TrainingConfig(learning_rate=5e-2, micro_batch_tokens=16, gradient_accumulation_steps=1,
                            clip_low=0.01, clip_high=0.01)
    metrics = Trainer(config, model).update(seqs)
    assert metrics["micro_batches"] == 3 and metrics["optimizer_updates"] == 3
    # Updates 2 and 3 run on moved weights: ratios leave [0.99, 1.01] and some tokens clip.
    assert metrics["clip_fraction"] > 0.0
    assert metrics["logprob_gap_max_abs"] < 1e-4


def test_lora_update_moves_only_adapters_and_saved_merged_weights_match(tmp_path):
    from app.engines.modeling import load_model

    model = build_tiny_model(seed=0)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    prompt = [1, 7, 8, 2, 1]
    seqs = [make_sequence(model, prompt, 6, seed=s, advantage=a) for s, a in ((0, 1.0), (1, -1.0))]
    trainer = Trainer(TrainingConfig(learning_rate=1e-2, lora=True, lora_r=4, lora_alpha=8), model)
    trainer.update(seqs)
    trainer.update(seqs)  # LoRA B starts at zero: the second update moves the effective weights
    lora_lp = trainer.logprobs(seqs)
    trainer.save(tmp_path / "ckpt", {"policy_version": 1})
    plain, _ = load_model(str(tmp_path / "ckpt" / "model"))
    inner = {k.replace(".base_layer", ""): v for k, v in trainer.model.get_base_model().state_dict().items()
             if "lora_" not in k}
    assert all(torch.equal(inner[k], v) for k, v in base.items())  # only adapters were trained
    plain_trainer = Trainer(TrainingConfig(), plain)
    for a, b in zip(lora_lp, plain_trainer.logprobs(seqs)):
        assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(lora_lp[0], Trainer(TrainingConfig(), build_tiny_model(0)).logprobs(seqs)[0], atol=1e-4)


@pytest.mark.parametrize("lora,estimator", [(False, "k3"), (True, "k3"), (False, "k2")])
def test_kl_to_reference_is_zero_at_start_and_grows_after_updates(lora, estimator):
    model = build_tiny_model(seed=0)
    prompt = [1, 11, 12, 2, 1]
    seqs = [make_sequence(model, prompt, 6, seed=s, advantage=a) for s, a in ((0, 1.0), (1, -1.0))]
    trainer = Trainer(TrainingConfig(learning_rate=1e-2, kl_coef=0.1, kl_estimator=estimator, lora=lora, lora_r=4,
                                     lora_alpha=8), model)
    assert trainer.update(seqs)["kl"] == pytest.approx(0.0, abs=1e-7)
    trainer.update(seqs)
    assert trainer.update(seqs)["kl"] > 1e-6


def test_lora_checkpoint_round_trip_restores_adapters_and_optimizer(tmp_path):
    prompt = [1, 21, 22, 2, 1]
    config = TrainingConfig(learning_rate=1e-2, lora=True, lora_r=4, lora_alpha=8)
    first = Trainer(config, build_tiny_model(seed=0))
    seqs = [make_sequence(build_tiny_model(0), prompt, 6, seed=s, advantage=a) for s, a in ((0, 1.0), (1, -1.0))]
    first.update(seqs)
    first.update(seqs)
    first.save(tmp_path / "ckpt", {"policy_version": 2})
    second = Trainer(config, build_tiny_model(seed=0))  # a new process: base model + fresh adapters
    assert second.load(tmp_path / "ckpt") == {"policy_version": 2}
    for a, b in zip(first.logprobs(seqs), second.logprobs(seqs)):
        assert torch.equal(a, b)
    state_a, state_b = first.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[k]["exp_avg"], state_b[k]["exp_avg"]) for k in state_a)
    first.update(seqs)
    second.update(seqs)
    for a, b in zip(first.logprobs(seqs), second.logprobs(seqs)):
        assert torch.equal(a, b)


def test_chunked_lm_head_gives_same_logprobs_and_gradients():
    from app.training import policy
    from app.training.batching import make_micro_batches

    model = build_tiny_model(seed=0)
    seq = make_sequence(model, [1, 31, 32, 2, 1], 10, seed=3, advantage=1.0)
    (mb,) = make_micro_batches([seq], 1024, "token")
    results = []
    for chunk in (None, 3):  # None: the default budget, one chunk for these few positions
        model.zero_grad()
        lp = policy.token_logprobs(model, mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.targets, head_chunk=chunk)
        lp.sum().backward()
        results.append((lp.detach(), model.lm_head.weight.grad.clone()))
    assert torch.allclose(results[0][0], results[1][0], atol=1e-6)
    diff = (results[0][1] - results[1][1]).abs().max()
    scale = results[0][1].abs().max()
    assert diff <= 1e-5 * scale, (diff, scale)
