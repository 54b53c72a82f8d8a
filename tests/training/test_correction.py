"""Off-policy correction (app.training.correction): each mode's weights, masks and gradients on tiny
problems, the denominator over kept tokens, per-token lags through micro-batches, and the
step metrics on the tiny model."""
from __future__ import annotations

import math
import random

import pytest
import torch

from app.engines.modeling import build_tiny_model
from app.runconfig import TrainingConfig
from app.training import correction
from app.training.batching import StepSequence, make_micro_batches
from app.training.grpo import policy_loss
from app.training.trainer import Trainer

MODES = [["token_tis"], ["seq_tis"], ["seq_mis"], ["geo_mask"], ["icepop"], ["none"], ["geo_mask", "token_tis"],
         ["seq_tis", "seq_mis", "icepop"]]


def config(modes, **extra) -> TrainingConfig:
    return TrainingConfig(off_policy_correction=modes, **extra)


def loss_grad(log_ratio, sequence_index, cfg, advantage=1.0, weights=None):
    """d loss / d logp of one micro-batch whose old logprobs are 0 and rollout = old - log_ratio;
    `weights` default to the token mean over the kept tokens (`mask_weights`' rule)."""
    log_ratio = torch.tensor(log_ratio, dtype=torch.float32)
    old = torch.zeros_like(log_ratio)
    fix = correction.token_correction(old, old - log_ratio, torch.tensor(sequence_index), cfg)
    if weights is None:
        weights = fix.keep.float() / fix.keep.sum()
    logp = old.clone().requires_grad_(True)
    loss, stats = policy_loss(logp, old, old - log_ratio, torch.full_like(old, advantage), weights, clip_low=0.2,
                              clip_high=0.28, tis_cap=cfg.tis_cap, correction=fix)
    loss.backward()
    return logp.grad, fix, stats


# --- each mode on a tiny problem ----------------------------------------------------------


@pytest.mark.parametrize("modes", MODES)
def test_every_mode_is_the_plain_loss_when_rollout_equals_trainer(modes):
    grad, fix, _ = loss_grad([0.0] * 6, [0, 0, 0, 1, 1, 1], config(modes), advantage=0.7)
    plain = torch.zeros(6, requires_grad=True)
    loss, _ = policy_loss(plain, plain.detach(), plain.detach(), torch.full((6,), 0.7), torch.full((6,), 1 / 6),
                          clip_low=0.2, clip_high=0.28, tis_cap=None)
    loss.backward()
    assert fix.keep.all() and torch.equal(fix.weight, torch.ones(6))
    assert torch.equal(grad, plain.grad)


def test_masked_tokens_leave_the_denominator_five_tokens_three_rejected():
    """slime PR #657's case: 3 of 5 tokens outside IcePop's [0.5, 2]; the 2 kept ones carry the
    whole step (1/2 each), not 1/5 each as a mask on the numerator alone would give."""
    seqs = [StepSequence([3, 4, 5, 6, 7, 8], [0, 1, 1, 1, 1, 1], [0.0, -1.0, -1.0, -1.0, -1.0, -1.0], 1.0, 0)]
    [mb] = make_micro_batches(seqs, 64, "token")
    assert mb.weights.tolist() == pytest.approx([0.2] * 5)
    old = torch.tensor([-1.0, -1.0 + 1.0, -1.0 - 1.0, -1.0, -1.0 + 0.9], dtype=torch.float32)  # r: 1, e, 1/e, 1, e^.9
    cfg = config("icepop")
    fix = correction.token_correction(old, mb.rollout_logprobs, mb.sequence_index, cfg)
    assert fix.keep.tolist() == [True, False, False, True, False]
    [total] = correction.mask_weights([[(mb, True, fix.keep)]], seqs, "token")
    assert total == pytest.approx(1.0) and mb.weights.tolist() == pytest.approx([0.5, 0, 0, 0.5, 0])
    logp = old.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old, mb.rollout_logprobs, mb.advantages, mb.weights, clip_low=0.2, clip_high=0.28,
                          tis_cap=None, correction=fix)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-0.5, 0.0, 0.0, -0.5, 0.0])


def test_a_masked_tokens_nan_loss_term_does_not_reach_the_sum():
    cfg = config("icepop")
    log_ratio = torch.tensor([0.0, 5.0])
    fix = correction.token_correction(torch.zeros(2), -log_ratio, torch.tensor([0, 0]), cfg)
    logp = torch.tensor([0.0, float("nan")], requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(2), -log_ratio, torch.ones(2), torch.tensor([1.0, 0.0]), clip_low=0.2,
                          clip_high=0.28, tis_cap=None, correction=fix)
    assert math.isfinite(float(loss))


def test_geo_mask_is_the_chains_geometric_mean_ratio():
    #           chain 0: mean 0.005 (kept)   chain 1: mean -0.0102 (below 0.99)   chain 2: 0.0099 (kept)
    log_ratio = [0.02, -0.01, 0.005, 0.005, -0.03, 0.0, -0.0006, 0.0297, 0.0, 0.0]
    index = [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    grad, fix, _ = loss_grad(log_ratio, index, config("geo_mask"))
    for chain in range(3):
        values = [r for r, i in zip(log_ratio, index) if i == chain]
        inside = 0.99 <= math.exp(sum(values) / len(values)) <= 1.01
        assert fix.keep[torch.tensor(index) == chain].tolist() == [inside] * len(values)
    assert fix.keep.tolist() == [True] * 4 + [False] * 3 + [True] * 3
    # no weight: each kept token carries 1/7 of the step, the masked chain none
    assert grad.tolist() == pytest.approx([-1 / 7] * 4 + [0.0] * 3 + [-1 / 7] * 3)
    sums, means = correction.chain_log_ratios(torch.tensor(log_ratio), torch.tensor(index))
    assert means[4].item() == pytest.approx(-0.0306 / 3) and sums[0].item() == pytest.approx(0.02)


def test_seq_tis_weights_every_token_by_its_chains_truncated_product():
    # chain 0: prod r = 3 (under the cap 5); chain 1: prod r = 8, truncated to 5
    log_ratio = [math.log(1.5), math.log(2.0), math.log(2.0), math.log(4.0), 0.0]
    grad, fix, stats = loss_grad(log_ratio, [0, 0, 1, 1, 1], config("seq_tis"), weights=torch.full((5,), 0.2))
    assert fix.weight.tolist() == pytest.approx([3.0, 3.0, 5.0, 5.0, 5.0])
    assert fix.truncated.tolist() == [False, False, True, True, True] and stats.tis_truncated == 3
    assert grad.tolist() == pytest.approx([-0.6, -0.6, -1.0, -1.0, -1.0])
    # token TIS would weight tokens alone: min(r_t, 2)
    _, token, _ = loss_grad(log_ratio, [0, 0, 1, 1, 1], config("token_tis"))
    assert token.weight.tolist() == pytest.approx([1.5, 2.0, 2.0, 2.0, 1.0])


def test_seq_mis_masks_a_chain_whose_product_leaves_the_bounds_though_each_token_is_inside():
    log_ratio = [math.log(1.3)] * 3 + [math.log(1.3), math.log(1 / 1.3), 0.0]  # products 2.197 and 1
    index = [0, 0, 0, 1, 1, 1]
    grad, fix, _ = loss_grad(log_ratio, index, config("seq_mis"))
    assert fix.keep.tolist() == [False] * 3 + [True] * 3
    assert grad.tolist() == pytest.approx([0.0] * 3 + [-1 / 3] * 3)
    _, icepop, _ = loss_grad(log_ratio, index, config("icepop"))
    assert icepop.keep.all()  # every token's own ratio is inside [0.5, 2]
    # Li et al.'s MIS, rho * 1{rho <= C}: seq_tis + seq_mis weights the kept chain by its product
    _, both, _ = loss_grad(log_ratio, index, config(["seq_tis", "seq_mis"]))
    assert both.keep.tolist() == fix.keep.tolist() and both.weight[3:].tolist() == pytest.approx([1.0] * 3)


def test_icepop_with_token_tis_above_beta_weights_kept_tokens_by_their_ratio():
    """IcePop's M(k) = k inside [alpha, beta], 0 outside (arXiv:2510.18855)."""
    log_ratio = [math.log(0.4), math.log(0.6), math.log(1.8), math.log(2.5)]
    cfg = config(["icepop", "token_tis"], tis_cap=2.0)
    grad, fix, _ = loss_grad(log_ratio, [0, 0, 0, 0], cfg, weights=torch.full((4,), 0.5))
    assert fix.keep.tolist() == [False, True, True, False]
    assert grad.tolist() == pytest.approx([0.0, -0.3, -0.9, 0.0])


def test_masked_weights_equal_the_plain_aggregation_when_nothing_is_masked_and_drop_masked_episodes():
    seqs = [StepSequence([1, 2, 3, 4], [0, 1, 1, 1], [0.0, -1, -1, -1], 1.0, episode_id=7),
            StepSequence([1, 2, 3], [0, 1, 1], [0.0, -1, -1], 1.0, episode_id=7),
            StepSequence([1, 2, 3, 4, 5], [0, 1, 1, 1, 1], [0.0, -1, -1, -1, -1], -1.0, episode_id=8)]
    for aggregation in ("token", "sequence"):
        batches = make_micro_batches(seqs, 8, aggregation)
        plain = [mb.weights.clone() for mb in batches]
        keeps = [torch.ones(mb.targets.numel(), dtype=torch.bool) for mb in batches]
        totals = correction.mask_weights([[(mb, True, k) for mb, k in zip(batches, keeps)]], seqs, aggregation)
        assert totals == pytest.approx([1.0])
        assert all(torch.equal(mb.weights, p) for mb, p in zip(batches, plain))
    # episode 8 masked whole: under "sequence" episode 7 is the only sample, its 5 tokens 1/5 each
    [mb] = make_micro_batches(seqs, 64, "sequence")
    assert mb.weights.tolist() == pytest.approx([0.125 if i == 2 else 0.1 for i in mb.sequence_index.tolist()])
    keep = mb.sequence_index != 2
    [total] = correction.mask_weights([[(mb, True, keep)]], seqs, "sequence")
    assert total == pytest.approx(1.0)
    assert mb.weights.tolist() == pytest.approx([0.0 if i == 2 else 0.2 for i in mb.sequence_index.tolist()])


def test_chain_level_modes_refuse_a_chain_split_across_micro_batches():
    seq = StepSequence([1, 2, 3], [0, 1, 1], [0.0, -1, -1], 1.0)
    whole = make_micro_batches([seq], 64, "token")
    correction.check_whole_chains(whole, [seq])
    with pytest.raises(RuntimeError, match="split across micro-batches"):
        correction.check_whole_chains(whole + whole, [seq])


# --- per-token lags -------------------------------------------------------------------------


@pytest.mark.parametrize("packing", [True, False])
def test_micro_batches_carry_each_trainable_tokens_lag(packing):
    seqs = [StepSequence([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 1, 1], [0.0] * 6, 1.0, 0, policy_lag=2,
                         token_lags=[0, 0, 2, 2, 1, 0]),
            StepSequence([1, 2, 3], [0, 1, 1], [0.0] * 3, 1.0, 1, policy_lag=3)]
    lags = {}
    for mb in make_micro_batches(seqs, 64, "token", packing=packing):
        assert mb.token_lag.dtype == torch.int64 and mb.token_lag.shape == mb.targets.shape
        for i, lag in zip(mb.sequence_index.tolist(), mb.token_lag.tolist()):
            lags.setdefault(i, []).append(lag)
    assert lags == {0: [2, 2, 1, 0], 1: [3, 3]}
    bad = StepSequence([1, 2, 3], [0, 1, 1], [0.0] * 3, 1.0, 5, token_lags=[0, 1])
    with pytest.raises(ValueError, match="token_lags holds 2 entries for 3 tokens"):
        make_micro_batches([bad], 64, "token", packing=packing)


# --- the trainer on the tiny model ----------------------------------------------------------


def chains(n_chains: int, length: int = 14, seed: int = 0) -> list[StepSequence]:
    rng = random.Random(seed)
    out = []
    for i in range(n_chains):
        ids = [rng.randrange(3, 400) for _ in range(length)]
        mask = [0] * 4 + [1] * (length - 4)
        out.append(StepSequence(ids, mask, [0.0] * length, 1.0 if i % 2 == 0 else -0.5, episode_id=i))
    return out


def on_policy(trainer: Trainer, seqs: list[StepSequence], shift=None) -> list[StepSequence]:
    """`seqs` with rollout logprobs = the trainer's own, minus `shift(i, position)` nats."""
    values = trainer.logprobs(seqs)
    out = []
    for i, (seq, lp) in enumerate(zip(seqs, values)):
        it = iter(lp.tolist())
        lps = [next(it) - (shift(i, t) if shift else 0.0) if m else 0.0 for t, m in enumerate(seq.loss_mask)]
        out.append(StepSequence(seq.token_ids, seq.loss_mask, lps, seq.advantage, seq.episode_id,
                                policy_lag=seq.policy_lag, token_lags=seq.token_lags))
    return out


def step_grads(cfg: TrainingConfig, seqs_of) -> tuple[dict, list[torch.Tensor]]:
    """One update of a fresh tiny-model trainer over `seqs_of(trainer)`: its metrics and the
    gradients the optimizer stepped with (max_grad_norm 0: unclipped)."""
    trainer = Trainer(cfg.model_copy(update={"max_grad_norm": 0.0, "learning_rate": 1e-3}), build_tiny_model(seed=0))
    grads = []
    step = trainer.optimizer.step

    def capture(*args, **kwargs):
        grads.extend(p.grad.clone() for p in trainer.params)
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    metrics = trainer.update(seqs_of(trainer))
    return metrics, grads


@pytest.mark.parametrize("modes", [["token_tis"], ["seq_tis"], ["seq_mis"], ["geo_mask"], ["icepop"],
                                   ["geo_mask", "token_tis"]])
def test_trainer_every_mode_steps_like_none_when_rollout_equals_trainer(modes):
    _, plain = step_grads(config("none"), lambda t: on_policy(t, chains(3)))
    metrics, grads = step_grads(config(modes), lambda t: on_policy(t, chains(3)))
    assert metrics["off_policy"]["tokens_masked_fraction"] == 0.0
    for a, b in zip(grads, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_trainer_a_masked_chain_adds_no_gradient_and_leaves_the_denominator(aggregation):
    """Chain 1's rollout logprobs sit 0.5 nats above the trainer's: its geometric-mean ratio
    e^-0.5 is outside [0.99, 1.01], so the step equals the step over chains 0 and 2 alone."""
    seqs = chains(3)
    cfg = config("geo_mask", loss_aggregation=aggregation)
    metrics, masked = step_grads(cfg, lambda t: on_policy(t, seqs, lambda i, _t: -0.5 if i == 1 else 0.0))
    _, alone = step_grads(cfg, lambda t: on_policy(t, [seqs[0], seqs[2]]))
    assert metrics["off_policy"]["sequences_masked_fraction"] == pytest.approx(1 / 3)
    assert metrics["off_policy"]["tokens_masked_fraction"] == pytest.approx(1 / 3)
    for a, b in zip(masked, alone):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    _, unmasked = step_grads(config("none", loss_aggregation=aggregation),
                             lambda t: on_policy(t, seqs, lambda i, _t: -0.5 if i == 1 else 0.0))
    assert any(not torch.allclose(a, b, rtol=1e-3, atol=1e-6) for a, b in zip(unmasked, alone))


def test_trainer_ratios_and_gap_by_lag_come_from_each_tokens_own_rollout_logprob():
    """One chain across two in-flight updates: tokens of lag 0, 1 and 2, each recorded 0, 0.1 and
    0.3 nats below the trainer.  The lag split counts each token once under its own lag, and an
    IcePop band [0.8, 1.25] masks exactly the lag-2 tokens (ratio e^0.3), not the lag-1 (e^0.1)."""
    lags = [0] * 4 + [2, 2, 2, 1, 1, 1, 1, 0, 0, 0]
    base = chains(2)
    seqs = [StepSequence(base[0].token_ids, base[0].loss_mask, base[0].logprobs, 1.0, 0, policy_lag=2,
                         token_lags=lags), base[1]]
    offset = {0: 0.0, 1: 0.1, 2: 0.3}

    def shift(i, t):
        return offset[lags[t]] if i == 0 else 0.0

    cfg = config("icepop", icepop_bounds=[0.8, 1.25])
    metrics, _ = step_grads(cfg, lambda t: on_policy(t, seqs, shift))
    off = metrics["off_policy"]
    assert (off["tokens_lag0"], off["tokens_lag1"], off["tokens_lag2plus"]) == (3 + 10, 4, 3)
    assert off["logprob_gap_lag0_mean_abs"] < 1e-5
    assert off["logprob_gap_lag1_mean_abs"] == pytest.approx(0.1, abs=1e-5)
    assert off["logprob_gap_lag2plus_mean_abs"] == pytest.approx(0.3, abs=1e-5)
    assert off["tokens_masked_fraction"] == pytest.approx(3 / 20) and off["sequences_masked_fraction"] == 0.0
    assert off["ratio_max"] == pytest.approx(math.exp(0.3), rel=1e-4)
    assert off["ratio_min"] == pytest.approx(1.0, abs=1e-5)
    # the older-weights gap is per token too: the chain's lag-0 tokens are not stale
    assert metrics["tokens_stale"] == 7
    assert metrics["logprob_gap_stale_max_abs"] == pytest.approx(0.3, abs=1e-5)


def test_off_policy_metrics_are_logged_with_the_default_token_tis():
    metrics, _ = step_grads(TrainingConfig(), lambda t: on_policy(t, chains(2), lambda i, _t: 0.05 * i))
    off = metrics["off_policy"]
    assert off["tokens"] == 20 and off["tokens_masked_fraction"] == 0.0 and off["sequences_masked_fraction"] == 0.0
    assert off["ratio_p01"] <= off["ratio_p50"] <= off["ratio_p99"] <= off["ratio_max"]
    assert off["ratio_max"] == pytest.approx(math.exp(0.05), rel=1e-4)
    assert 0.99 < off["weight_ess_fraction"] < 1.0  # two weight levels, 1 and e^0.05
    assert off["tokens_lag1"] == 0 and off["logprob_gap_lag1_mean_abs"] is None
    assert metrics["tis_weight_mean"] == pytest.approx((1 + math.exp(0.05)) / 2, rel=1e-4)


def test_trainer_several_updates_a_wholly_masked_update_steps_with_zero_gradient():
    """One chain per micro-batch and per update (gradient_accumulation_steps 1): the update of the
    masked chain 1 has nothing kept, so its mean is 0 (not 0/0) and its gradient exactly zero."""
    seqs = chains(3)
    cfg = config("geo_mask", micro_batch_tokens=16, gradient_accumulation_steps=1)
    captured: list[list[torch.Tensor]] = []

    def run(trainer):
        step = trainer.optimizer.step

        def capture(*args, **kwargs):
            captured.append([p.grad.clone() for p in trainer.params if p.grad is not None])
            return step(*args, **kwargs)

        trainer.optimizer.step = capture
        return on_policy(trainer, seqs, lambda i, _t: -0.5 if i == 1 else 0.0)

    metrics, _ = step_grads(cfg, run)
    assert metrics["optimizer_updates"] == 3 and metrics["nonfinite_updates_skipped"] == 0
    assert math.isfinite(metrics["loss"]) and metrics["off_policy"]["sequences_masked_fraction"] == pytest.approx(1 / 3)
    norms = [sum(float(g.abs().sum()) for g in grads) for grads in captured]
    assert sorted(n == 0.0 for n in norms) == [False, False, True]


def test_a_steps_off_policy_metrics_reach_the_run_page_charts_and_tensorboard(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    from app import config as settings
    from app.api.dashboard.charts import step_charts
    from app.paths import RunPaths
    from app.tables import TrainingStep
    from app.training.steps import _log_tensorboard

    seqs = chains(2)
    lags = [0] * 4 + [1] * 5 + [3] * 5
    seqs[1] = StepSequence(seqs[1].token_ids, seqs[1].loss_mask, seqs[1].logprobs, -0.5, 1, policy_lag=3,
                           token_lags=lags)
    cfg = config(["geo_mask", "token_tis"])
    metrics, _ = step_grads(cfg, lambda t: on_policy(t, seqs, lambda i, p: 0.2 * lags[p] if i == 1 else 0.0))
    off = metrics["off_policy"]
    assert off["sequences_masked_fraction"] == 0.5 and off["tokens_lag1"] == 5 and off["tokens_lag2plus"] == 5
    run_config = {"training": cfg.to_dict()}
    charts, _missing = step_charts([TrainingStep(step=0, status="completed", metrics=metrics)], run_config)
    by_title = {c["title"]: c for c in charts}
    lag_chart = by_title["logprob gap by lag (mean |Δ|, nats)"]
    assert [s["label"] for s in lag_chart["series"]] == ["lag 0", "lag 1", "lag 2+"]
    assert lag_chart["series"][2]["values"] == [pytest.approx(0.6, abs=1e-5)]
    masked = by_title["off-policy masked (fraction)"]
    assert masked["series"][1]["values"] == [0.5] and masked["range"] == [0.0, 1.0]
    assert len(by_title["off-policy ratio exp(old - rollout)"]["series"]) == 5
    # an IcePop-only run has no importance weight: its weight charts say so instead of charting 1.0
    bare = {"training": config("icepop").to_dict()}
    charts, _ = step_charts([TrainingStep(step=0, status="completed", metrics=metrics)], bare)
    ess = next(c for c in charts if c["title"].startswith("off-policy weights"))
    assert ess["series"][0]["values"] == [None] and "no importance weight" in ess["not_computed"]

    monkeypatch.setenv("TURNSTILE_VAR_DIR", str(tmp_path / "var"))
    settings.reset_settings()
    try:
        _log_tensorboard(9, 0, metrics)
        found = {}
        for path in RunPaths(9).tensorboard.glob("events.out.tfevents*"):
            for event in EventFileLoader(str(path)).Load():
                for value in event.summary.value:
                    found[value.tag] = float(tensor_util.make_ndarray(value.tensor))
    finally:
        settings.reset_settings()
    assert found["train/off_policy/tokens_masked_fraction"] == pytest.approx(off["tokens_masked_fraction"])
    assert found["train/off_policy/logprob_gap_lag1_mean_abs"] == pytest.approx(0.2, abs=1e-5)
    assert found["train/loss"] == pytest.approx(metrics["loss"])


def test_chain_spread_splits_on_policy_chains_from_lagged_ones_by_their_oldest_token():
    # chain 0: every token lag 0, log-ratios +-1e-5 (numerical noise); chain 1: one token lag 1 in
    # it, so the whole chain counts as lagged; its mean log-ratio is (0 + 0.3 + 0) / 3 = 0.1.
    log_ratio = torch.tensor([1e-5, -1e-5, 0.0, 0.3, 0.0])
    lag = torch.tensor([0, 0, 0, 1, 0])
    seq = torch.tensor([0, 0, 1, 1, 1])
    out = correction.chain_spread(log_ratio, lag, seq)
    assert out["chains_lag0"] == 1 and out["chains_lagged"] == 1
    assert out["geo_ratio_lag0_min"] == pytest.approx(1.0, abs=1e-9) == out["geo_ratio_lag0_max"]
    assert out["geo_ratio_lagged_max"] == pytest.approx(math.exp(0.1))
    assert out["log_ratio_sum_lagged_min"] == pytest.approx(0.3)
    assert out["token_ratio_lagged_p999"] == pytest.approx(math.exp(0.3))
    assert out["token_ratio_lag0_p001"] == pytest.approx(math.exp(-1e-5))


def test_chain_spread_of_a_step_with_no_lagged_chain_is_none_not_zero():
    out = correction.chain_spread(torch.tensor([0.01, -0.02]), torch.tensor([0, 0]), torch.tensor([0, 0]))
    assert out["chains_lagged"] == 0
    assert out["geo_ratio_lagged_min"] is None and out["token_ratio_lagged_p999"] is None
