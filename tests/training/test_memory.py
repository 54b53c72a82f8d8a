"""Checkpointing chosen by memory: the memory model's plans, the trainer applying them per
step, and the model against measured peaks of the tiny model on CPU (loose bound)."""
from __future__ import annotations

import importlib.util
import random

import pytest

from app.config import ROOT
from app.engines.modeling import build_tiny_model
from app.runconfig import TrainingConfig
from app.training import memory, policy
from app.training.batching import StepSequence
from app.training.trainer import Trainer

QWEN3_1_7B = memory.Shape(hidden=2048, q=2048, kv=1024, intermediate=6144, layers=28, vocab=151936)


def test_plan_is_none_then_selective_then_full_as_the_budget_shrinks():
    tokens = 16384
    none = memory.activation_bytes(QWEN3_1_7B, tokens, 0, act_bytes=2)
    full = memory.activation_bytes(QWEN3_1_7B, tokens, 28, act_bytes=2)
    assert full < none
    assert memory.plan_checkpointing(QWEN3_1_7B, tokens, none, act_bytes=2).mode == "none"
    middle = memory.plan_checkpointing(QWEN3_1_7B, tokens, (none + full) / 2, act_bytes=2)
    assert middle.mode == "selective" and 0 < len(middle.layers) < 28
    assert middle.layers == memory.spread(28, len(middle.layers)) and middle.layers[0] == 0
    assert middle.predicted_bytes <= (none + full) / 2
    # the fewest recomputed layers that fit: one fewer would not fit
    assert memory.activation_bytes(QWEN3_1_7B, tokens, len(middle.layers) - 1, act_bytes=2) > (none + full) / 2
    assert memory.spread(28, 14) == tuple(range(0, 28, 2)) and memory.spread(28, 4) == (0, 7, 14, 21)
    assert memory.plan_checkpointing(QWEN3_1_7B, tokens, full, act_bytes=2).mode == "full"
    assert memory.plan_checkpointing(QWEN3_1_7B, tokens, 1, act_bytes=2).mode == "full"  # nothing fits: full
    with pytest.raises(ValueError, match="checkpointed layers"):
        memory.activation_bytes(QWEN3_1_7B, tokens, 29)


def chain(tokens, seed=0):
    rng = random.Random(seed)
    return StepSequence([rng.randrange(3, 49000) for _ in range(tokens)], [0] * (tokens - 32) + [1] * 32,
                        [-9.0] * tokens, 1.0)


def test_trainer_picks_checkpointing_per_step_from_the_budget():
    trainer = Trainer(TrainingConfig(activation_memory_gib=0.001, micro_batch_tokens=4096), build_tiny_model(seed=0))
    assert trainer.checkpointing_auto and trainer.activation_checkpointing is False
    metrics = trainer.update([chain(600)])  # ~5 MiB of activations > 1 MiB: full
    assert metrics["checkpointing"] == "full" and metrics["checkpointed_layers"] == 2
    assert policy.checkpointed_layers(trainer.model) == [0, 1]
    roomy = Trainer(TrainingConfig(activation_memory_gib=4.0), build_tiny_model(seed=0))
    metrics = roomy.update([chain(600)])
    assert metrics["checkpointing"] == "none" and policy.checkpointed_layers(roomy.model) == []
    assert 0 < metrics["activation_memory_predicted_gib"] < 4.0
    # a fixed setting is kept whatever the budget
    fixed = Trainer(TrainingConfig(activation_memory_gib=0.001, activation_checkpointing=False), build_tiny_model(seed=0))
    assert fixed.update([chain(600)])["checkpointing"] == "none"


def test_memory_model_is_within_a_factor_of_two_of_measured_peaks_on_cpu():
    spec = importlib.util.spec_from_file_location("memory_model_bench", ROOT / "bench" / "memory_model.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for scheme in ("none", "full"):
        r = bench.measure_fresh(4096, scheme, 64, "cpu")
        assert 0.5 <= r["measured"] / r["predicted"] <= 2.0, r
