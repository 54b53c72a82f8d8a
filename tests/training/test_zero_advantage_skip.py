"""`training.skip_zero_advantage`: chains whose advantage is 0 never reach a forward pass, and the
update of the other chains is the one the trainer makes when it scores them all."""
from __future__ import annotations


from app.engines.modeling import build_tiny_model
from app.runconfig import TrainingConfig
from app.training.batching import StepSequence
from app.training.trainer import Trainer

PROMPT = [1, 1000, 2000, 3000, 2, 1]


def _sequences() -> list[StepSequence]:
    """Two chains with signal, two with advantage 0 (each marked by a token no other chain has)."""
    out = []
    for marker, adv in ((4001, 0.5), (4002, -0.5), (4003, 0.0), (4004, 0.0)):
        ids = PROMPT + [marker, 700, 701, 702]
        out.append(StepSequence(ids, [0] * len(PROMPT) + [1] * 4, [0.0] * len(PROMPT) + [-7.0] * 4, adv))
    return out


def _trained(skip: bool) -> tuple[dict, dict, list[list[int]]]:
    model = build_tiny_model(seed=0)
    trainer = Trainer(TrainingConfig(learning_rate=1e-3, skip_zero_advantage=skip), model)
    seen: list[list[int]] = []
    forward = trainer.forward

    def spy(input_ids, *args, **kwargs):
        seen.append(input_ids.flatten().tolist())
        return forward(input_ids, *args, **kwargs)

    trainer.forward = spy
    metrics = trainer.update(_sequences())
    return metrics, {k: v.detach().clone() for k, v in model.state_dict().items()}, seen


def test_zero_advantage_chains_never_reach_a_forward_pass_and_the_update_is_unchanged():
    on, weights_on, seen_on = _trained(skip=True)
    off, weights_off, seen_off = _trained(skip=False)
    fed_on = {t for ids in seen_on for t in ids}
    assert {4001, 4002} <= fed_on and not {4003, 4004} & fed_on
    assert {4003, 4004} <= {t for ids in seen_off for t in ids}  # without the flag they are scored (the test can fail)
    assert on["sequences_zero_advantage_skipped"] == 2 and off["sequences_zero_advantage_skipped"] == 0
    assert on["tokens_trained"] == 8 and off["tokens_trained"] == 16
    assert abs(on["loss"] - off["loss"]) < 1e-6
    moved = max(float((weights_on[k] - build_tiny_model(seed=0).state_dict()[k]).abs().max()) for k in weights_on)
    assert moved > 1e-5  # the chains with signal did train
    diff = max(float((weights_on[k] - weights_off[k]).abs().max()) for k in weights_on)
    assert diff < 1e-6, diff


def test_a_step_of_zero_advantage_chains_only_runs_no_forward_pass():
    model = build_tiny_model(seed=0)
    trainer = Trainer(TrainingConfig(learning_rate=1e-2, skip_zero_advantage=True), model)
    calls = []
    trainer.forward = lambda *a, **k: calls.append(a)  # any forward pass would be recorded (and fail)
    seqs = [s for s in _sequences() if s.advantage == 0.0]
    metrics = trainer.update(seqs)
    assert calls == [] and metrics["optimizer_updates"] == 0 and metrics["sequences_zero_advantage_skipped"] == 2


def test_with_a_kl_term_zero_advantage_chains_are_still_trained():
    trainer = Trainer(TrainingConfig(learning_rate=1e-3, skip_zero_advantage=True, kl_coef=0.1), build_tiny_model(seed=0))
    metrics = trainer.update(_sequences())
    assert metrics["sequences_zero_advantage_skipped"] == 0 and metrics["tokens_trained"] == 16
