"""LoRA tenants on one trainer: each run learns exactly as if it were alone.

Symmetric isolation (two runs with equal data and seeds, steps interleaved with a third run
between them: bit-equal losses, grad norms, probe logprobs and greedy samples at every step),
asymmetric isolation (20 steps of A leave B's logprobs, adapter and AdamW state byte-identical),
failure scope (a NaN loss skips that run's update only; a corrupted adapter file fails that
run's load alone, with the cause) and the pool's shape check.  Tiny random-init model, CPU.
"""
from __future__ import annotations

import random

import pytest
import torch

from app.engines.modeling import tiny_config
from app.runconfig import TrainingConfig
from app.training import policy
from app.training.batching import StepSequence
from app.training.tenants import TenantPool
from app.training.trainer import Trainer


def sequences(seed: int, n: int = 4, nan: bool = False) -> list[StepSequence]:
    """`n` random sequences, the second half of each trainable; advantages +1 / -0.5 (NaN: `nan`)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randrange(8, 20)
        ids = [rng.randrange(3, VOCAB) for _ in range(length)]
        mask = [0] * (length // 2) + [1] * (length - length // 2)
        lps = [-10.0 + rng.random() if m else 0.0 for m in mask]
        advantage = float("nan") if nan else (1.0 if i % 2 == 0 else -0.5)
        out.append(StepSequence(ids, mask, lps, advantage=advantage, episode_id=i))
    return out


def config(**overrides) -> TrainingConfig:
    values = {"lora": True, "lora_r": 4, "lora_alpha": 8, "learning_rate": 1e-2, "seed": 7, "tis_cap": None}
    return TrainingConfig(**{**values, **overrides})


VOCAB = 512


def small_model():
    """The tiny llama with a 512-token vocabulary (the LM head dominates the tiny model's step
    cost with SmolLM2's 49,152), seeded: every call gives the same weights."""
    from transformers import LlamaForCausalLM

    cfg = tiny_config()
    cfg.vocab_size = VOCAB
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(cfg).eval()


def new_pool(**overrides) -> TenantPool:
    return TenantPool(Trainer(config(**overrides), small_model()), "tiny")


PROBE = sequences(999, n=2)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def greedy(pool: TenantPool, prompt=(5, 17, 300, 42), tokens: int = 6) -> list[int]:
    """Greedy continuation of `prompt` under the active tenant (no KV cache, fp32)."""
    lm = policy.causal_lm(pool.trainer.model)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(tokens):
            logits = lm(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def snapshot(pool: TenantPool, run_id: int) -> dict:
    """Clones of a parked tenant's adapter and AdamW tensors, by name."""
    tenant = pool.tenants[run_id]
    adapter = {k: v.clone() for k, v in tenant.adapter.items()}
    optimizer = {k: {s: v.clone() for s, v in state.items()} for k, state in tenant.optimizer.items()}
    return {"adapter": adapter, "optimizer": optimizer}


def assert_bytes_equal(a: dict, b: dict) -> None:
    assert a["adapter"].keys() == b["adapter"].keys() and a["optimizer"].keys() == b["optimizer"].keys()
    for name, tensor in a["adapter"].items():
        assert torch.equal(tensor, b["adapter"][name]), name
    for name, state in a["optimizer"].items():
        for key, tensor in state.items():
            assert torch.equal(tensor, b["optimizer"][name][key]), (name, key)


def test_symmetric_runs_interleaved_with_a_third_are_bit_equal_and_equal_to_a_run_alone():
    pool = new_pool()
    alone = new_pool()
    cfg, other = config(), config(seed=11, learning_rate=3e-2, max_grad_norm=0.5)
    for step in range(4):
        data = sequences(step)
        results = {}
        for run, run_cfg, run_data in ((1, cfg, data), (3, other, sequences(100 + step)), (2, cfg, data)):
            pool.activate(run, run_cfg)
            metrics = pool.trainer.update(run_data)
            results[run] = (metrics, pool.trainer.logprobs(PROBE), greedy(pool))
        alone.activate(1, cfg)
        solo = (alone.trainer.update(data), alone.trainer.logprobs(PROBE), greedy(alone))
        for a, b in ((results[1], results[2]), (results[1], solo)):
            assert a[0]["loss"] == b[0]["loss"] and a[0]["grad_norm"] == b[0]["grad_norm"], step
            assert all(torch.equal(x, y) for x, y in zip(a[1], b[1])), step
            assert a[2] == b[2], step
        assert results[1][0]["loss"] != results[3][0]["loss"]  # the third run did train, differently
        assert results[1][0]["optimizer_updates"] == 1 and results[1][0]["grad_norm"] > 0


def test_training_a_for_20_steps_leaves_b_byte_identical():
    pool = new_pool()
    pool.activate(2, config(seed=3))
    pool.trainer.update(sequences(50))  # B has AdamW moments and a step counter
    probe_before = pool.trainer.logprobs(PROBE)
    sample_before = greedy(pool)
    pool.activate(1, config())
    b_before = snapshot(pool, 2)
    first = pool.trainer.logprobs(PROBE)
    for step in range(20):
        pool.trainer.update(sequences(step))
    assert not torch.equal(first[0], pool.trainer.logprobs(PROBE)[0])  # A moved
    assert_bytes_equal(snapshot(pool, 2), b_before)
    pool.drop(1)  # ending A touches nothing of B either
    pool.activate(2, config(seed=3))
    assert all(torch.equal(x, y) for x, y in zip(pool.trainer.logprobs(PROBE), probe_before))
    assert greedy(pool) == sample_before
    steps = {float(s["step"]) for s in pool.trainer.optimizer.state.values()}
    assert steps == {1.0}  # B's own Adam step counter, not A's 20


def test_a_nan_loss_skips_that_runs_update_only():
    pool, reference = new_pool(), new_pool()
    for p in (pool, reference):
        p.activate(1, config())
        p.trainer.update(sequences(0))
        p.activate(2, config(seed=5))
        p.trainer.update(sequences(1))
    pool.activate(1, config())
    before = {k: v.clone() for k, v in pool.trainer.model.state_dict().items() if "lora_" in k}
    metrics = pool.trainer.update(sequences(2, nan=True))
    assert metrics["nonfinite_updates_skipped"] == 1 and metrics["loss"] is None
    after = {k: v for k, v in pool.trainer.model.state_dict().items() if "lora_" in k}
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert {float(s["step"]) for s in pool.trainer.optimizer.state.values()} == {1.0}
    # B's next step is the step it takes without A's failure; A's next one too.
    for p in (pool, reference):
        p.activate(2, config(seed=5))
    assert pool.trainer.update(sequences(3))["loss"] == reference.trainer.update(sequences(3))["loss"]
    for p in (pool, reference):
        p.activate(1, config())
    assert pool.trainer.update(sequences(4))["grad_norm"] == reference.trainer.update(sequences(4))["grad_norm"]


def test_a_corrupted_adapter_file_fails_that_run_alone_with_the_cause(tmp_path):
    pool = new_pool()
    pool.activate(1, config())
    pool.trainer.update(sequences(0))
    pool.trainer.save(tmp_path / "a", {"policy_version": 1})
    pool.activate(2, config(seed=5))
    pool.trainer.update(sequences(1))
    pool.activate(1, config())
    b_before = snapshot(pool, 2)
    (tmp_path / "a" / "adapter.pt").write_bytes(b"\x00not a torch file")
    with pytest.raises(ValueError, match=r"adapter\.pt: the LoRA adapter file cannot be read"):
        pool.trainer.load(tmp_path / "a")
    pool.drop(1)
    assert_bytes_equal(snapshot(pool, 2), b_before)
    pool.activate(2, config(seed=5))
    assert pool.trainer.update(sequences(2))["grad_norm"] > 0


def test_a_checkpoint_restores_a_tenant_bit_for_bit(tmp_path):
    pool, alone = new_pool(), new_pool()
    pool.activate(1, config())
    pool.trainer.update(sequences(0))
    pool.trainer.save(tmp_path / "a", {"policy_version": 1})
    pool.activate(2, config(seed=5))
    pool.trainer.update(sequences(1))
    pool.drop(1)
    pool.activate(1, config())  # a fresh tenant (e.g. after a worker restart) loads its checkpoint
    pool.trainer.load(tmp_path / "a")
    alone.activate(1, config())
    alone.trainer.update(sequences(0))
    assert pool.trainer.update(sequences(2))["loss"] == alone.trainer.update(sequences(2))["loss"]


def test_a_run_of_another_lora_shape_does_not_join_the_pool():
    pool = new_pool()
    assert not pool.accepts("tiny", config(lora_r=8))
    assert not pool.accepts("smollm2", config())
    assert pool.accepts("tiny", config(seed=1, learning_rate=1e-3))
    with pytest.raises(ValueError, match="does not fit the pool"):
        pool.activate(1, config(lora_alpha=16))


def test_lora_target_modules_choose_the_adapted_projections():
    pool = new_pool(lora_target_modules=["q_proj", "v_proj"])
    names = {n.split(".")[-4] for n in pool.params}
    assert names == {"q_proj", "v_proj"}
    with pytest.raises(ValueError):
        config(lora_target_modules=["lm_head"])
