"""Long sequences and packing in the trainer: packed == padded, checkpointing == none,
a too-long chain fails before any work, no KV cache, peft only with LoRA."""
from __future__ import annotations

import random
import subprocess
import sys

from app.config import ROOT

import pytest
import torch

from app.engines.modeling import build_tiny_model
from app.runconfig import TrainingConfig
from app.training import policy
from app.training.batching import StepSequence, make_micro_batches
from app.training.trainer import SequenceTooLongError, Trainer


def random_sequences(lengths, seed=0):
    """Sequences of random ids, the second half of each trainable, rollout logprobs near -10."""
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = [rng.randrange(3, 49000) for _ in range(n)]
        mask = [0] * (n // 2) + [1] * (n - n // 2)
        lps = [-10.0 + rng.random() if m else 0.0 for m in mask]
        out.append(StepSequence(ids, mask, lps, advantage=1.0 if i % 2 == 0 else -0.5, episode_id=i))
    return out


LENGTHS = [37, 20, 64, 11, 50, 29]
LR = 1e-3


def assert_same_update(after_a: dict, after_b: dict, lr: float = LR) -> None:
    """Weights after one AdamW step from the same start agree.  The first AdamW step moves an
    element by ~lr * g / (|g| + eps), so an element whose gradient is ~0 may differ by up to 2 lr
    on float noise alone; a real difference in gradients shifts the mean difference to ~lr."""
    for name, w in after_a.items():
        assert (w - after_b[name]).abs().mean() <= 0.01 * lr, name


def grads_of(model, batches):
    """Gradients of sum(advantage * weight * logprob) over the micro-batches (float32 per parameter)."""
    model.zero_grad(set_to_none=True)
    forward = policy.TokenLogprobs(model)
    values = []
    for mb in batches:
        lp = forward(mb.input_ids, mb.attention_mask, mb.position_ids, mb.rows, mb.cols, mb.targets)
        (lp * mb.advantages * mb.weights).sum().backward()
        values.append((mb.sequence_index, lp.detach()))
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    index = torch.cat([i for i, _ in values])
    logprobs = torch.cat([v for _, v in values])[torch.argsort(index, stable=True)]
    return logprobs, grads


def test_packed_micro_batches_hold_several_sequences_without_padding():
    seqs = random_sequences(LENGTHS)
    packed = make_micro_batches(seqs, 128, "token", packing=True)
    padded = make_micro_batches(seqs, 128, "token", packing=False)
    assert len(packed) < len(seqs)
    assert all(mb.input_ids.shape[0] == 1 and mb.attention_mask is None for mb in packed)
    assert all(mb.tokens == mb.padded_tokens <= 128 for mb in packed)
    assert sum(mb.tokens for mb in packed) == sum(LENGTHS)
    assert sum(mb.padded_tokens for mb in padded) > sum(LENGTHS)
    # Position ids restart at 0 at each packed sequence's start.
    for mb in packed:
        starts = int((mb.position_ids[0] == 0).sum())
        assert starts == len(mb.sequence_index.unique())
    assert sorted(torch.cat([mb.sequence_index for mb in packed]).unique().tolist()) == list(range(len(seqs)))


def test_packed_and_padded_give_equal_logprobs_and_gradients():
    model = build_tiny_model(seed=0).train()
    seqs = random_sequences(LENGTHS)
    lp_packed, g_packed = grads_of(model, make_micro_batches(seqs, 128, "token", packing=True))
    lp_padded, g_padded = grads_of(model, make_micro_batches(seqs, 128, "token", packing=False))
    assert lp_packed.shape == lp_padded.shape == (sum(n - n // 2 for n in LENGTHS),)
    assert torch.allclose(lp_packed, lp_padded, atol=2e-5), (lp_packed - lp_padded).abs().max()
    for name, g in g_packed.items():
        scale = g_padded[name].abs().max().clamp_min(1e-12)
        assert (g - g_padded[name]).abs().max() <= 1e-4 * scale, name
    # Not vacuous: a packed row without restarting positions (one long sequence) differs.
    (mb,) = make_micro_batches(seqs[:2], 128, "token", packing=True)
    with torch.no_grad():
        joined = policy.token_logprobs(model, mb.input_ids, None, mb.rows, mb.cols, mb.targets)
    assert (joined - lp_packed[: joined.numel()]).abs().max() > 1e-3


def test_trainer_step_packed_equals_padded():
    seqs = random_sequences(LENGTHS, seed=1)
    results = []
    for packing in (True, False):
        trainer = Trainer(TrainingConfig(learning_rate=LR, micro_batch_tokens=128, packing=packing),
                          build_tiny_model(seed=0))
        metrics = trainer.update(seqs)
        results.append((metrics, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}))
    (packed, w_packed), (padded, w_padded) = results
    assert packed["padded_tokens"] == packed["tokens_processed"] < padded["padded_tokens"]
    assert packed["micro_batches"] < padded["micro_batches"] or packed["micro_batches"] < len(seqs)
    assert packed["loss"] == pytest.approx(padded["loss"], rel=1e-5, abs=1e-7)
    assert packed["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-4)
    assert_same_update(w_packed, w_padded)


class CountingActivation(torch.nn.Module):
    """Wraps an activation function and counts its calls (forward hooks do not fire when
    transformers' checkpointing recomputes a layer, a submodule's forward does)."""

    def __init__(self, act, calls: list):
        super().__init__()
        self.act, self.calls = act, calls

    def forward(self, x):
        self.calls.append(1)
        return self.act(x)


def test_activation_checkpointing_recomputes_layers_and_changes_nothing():
    seqs = random_sequences([120, 90, 60], seed=2)
    results = []
    for on in (False, True):
        model = build_tiny_model(seed=0)
        calls = []
        mlp = model.model.layers[0].mlp
        mlp.act_fn = CountingActivation(mlp.act_fn, calls)
        trainer = Trainer(TrainingConfig(learning_rate=LR, micro_batch_tokens=512, activation_checkpointing=on), model)
        assert trainer.activation_checkpointing is on
        assert model.is_activation_checkpointing is on
        metrics = trainer.update(seqs)
        results.append((metrics, len(calls), {k: v.detach().clone() for k, v in model.state_dict().items()}))
    (off, calls_off, w_off), (on, calls_on, w_on) = results
    assert calls_on == 2 * calls_off  # each checkpointed layer runs again in the backward pass
    assert on["activation_checkpointing"] and not off["activation_checkpointing"]
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-6, abs=1e-8)
    assert on["grad_norm"] == pytest.approx(off["grad_norm"], rel=1e-5)
    assert_same_update(w_on, w_off)


def test_activation_checkpointing_defaults_off_on_cpu():
    trainer = Trainer(TrainingConfig(), build_tiny_model(seed=0))
    assert trainer.activation_checkpointing is False


def test_too_long_chain_fails_before_any_forward_with_length_and_limit():
    model = build_tiny_model(seed=0)
    calls = []
    model.model.register_forward_hook(lambda *_: calls.append(1))
    trainer = Trainer(TrainingConfig(max_sequence_tokens=100), model)
    seqs = random_sequences([60, 150, 80])
    with pytest.raises(SequenceTooLongError, match=r"150 tokens \(episode 1\).*limit of 100 tokens"):
        trainer.update(seqs)
    with pytest.raises(SequenceTooLongError, match="150"):
        trainer.logprobs(seqs)
    assert calls == []
    # Default: the model's max_position_embeddings (8192 for the tiny model).
    default = Trainer(TrainingConfig(), build_tiny_model(seed=0))
    assert default.max_sequence_tokens == 8192
    with pytest.raises(SequenceTooLongError, match="8193 tokens.*8192.*max_position_embeddings"):
        default.update(random_sequences([8193]))


def test_training_forward_builds_no_kv_cache(monkeypatch):
    model = build_tiny_model(seed=0).train()
    seen = []
    original = type(model.model).forward

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("use_cache"))
        out = original(self, *args, **kwargs)
        seen.append(out.past_key_values)
        return out

    monkeypatch.setattr(type(model.model), "forward", spy)
    (mb,) = make_micro_batches(random_sequences([40]), 128, "token", packing=True)
    policy.token_logprobs(model, mb.input_ids, None, mb.rows, mb.cols, mb.targets, position_ids=mb.position_ids)
    assert seen == [False, None]


def test_is_lora_does_not_import_peft():
    code = ("import sys; from app.engines.modeling import build_tiny_model; from app.training import policy; "
            "from app.training.trainer import Trainer; from app.runconfig import TrainingConfig; "
            "t = Trainer(TrainingConfig(), build_tiny_model(0)); assert not policy.is_lora(t.model); "
            "print('peft' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_packing_defaults_to_the_attention_kernels():
    """Packed rows by default only where attention has variable-length kernels; sdpa pads."""
    assert Trainer(TrainingConfig(), build_tiny_model(seed=0)).packing is False  # tiny model: sdpa
    model = build_tiny_model(seed=0)
    model.config._attn_implementation = "flash_attention_2"
    assert Trainer(TrainingConfig(), model).packing is True
    assert Trainer(TrainingConfig(packing=True), build_tiny_model(seed=0)).packing is True


def test_trainer_scores_with_dropout_off_as_the_engine_samples():
    """A model whose config carries attention dropout (and LoRA dropout, were it allowed) would
    score sampled tokens under a noisy distribution while training; the trainer switches every
    dropout off, so its logprobs equal the inference (engine) forward's."""
    model = build_tiny_model(seed=0)
    for module in model.modules():
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.5
    seqs = random_sequences([60, 40], seed=4)
    (mb,) = make_micro_batches(seqs, 256, "token")
    with torch.no_grad():
        engine = policy.token_logprobs(model.eval(), mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.targets)
        noisy = policy.token_logprobs(model.train(), mb.input_ids, mb.attention_mask, mb.rows, mb.cols, mb.targets)
    assert (noisy - engine).abs().max() > 0.1  # the check can fail: dropout on moves the logprobs
    trainer = Trainer(TrainingConfig(), model)
    assert trainer.model.training  # checkpointing acts only in training mode
    scored = torch.cat(trainer.logprobs(seqs))
    index = torch.argsort(mb.sequence_index, stable=True)
    assert torch.allclose(scored, engine[index], atol=1e-6)


def test_lora_dropout_above_zero_is_refused_at_run_creation():
    from app.runconfig import RunConfig

    with pytest.raises(ValueError, match="lora_dropout: 0.1 is refused"):
        TrainingConfig(lora=True, lora_dropout=0.1)
    with pytest.raises(ValueError, match="lora_dropout"):
        RunConfig.model_validate({"training": {"lora": True, "lora_dropout": 0.05}})
    assert TrainingConfig(lora=True).lora_dropout == 0.0


def test_padding_fraction_and_longest_micro_batch_are_step_metrics():
    seqs = random_sequences([100, 30, 20], seed=5)
    metrics = Trainer(TrainingConfig(micro_batch_tokens=128), build_tiny_model(seed=0)).update(seqs)
    # padded: [100] alone, [30, 20] in 2 rows of 30 -> 160 slots for 150 tokens
    assert metrics["padded_tokens"] == 160 and metrics["tokens_processed"] == 150
    assert metrics["padding_fraction"] == pytest.approx(10 / 160)
    assert metrics["longest_micro_batch_tokens"] == 100
