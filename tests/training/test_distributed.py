"""FSDP2 across 2 real processes (torchrun, gloo, CPU) equals the single-process trainer."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

from app.config import ROOT

import pytest

from app.engines.modeling import build_tiny_model, read_metadata, read_state_dict
from app.training.trainer import Trainer
RANKS = Path(__file__).with_name("fsdp_ranks.py")


def _ranks_module():
    spec = importlib.util.spec_from_file_location("fsdp_ranks", RANKS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_same_weights(model, folder: Path, lr: float) -> None:
    """The exported safetensors equal `model`'s weights.  After AdamW steps an element whose
    gradient is ~0 may move by up to ~lr on float noise alone, so the bound is on the mean
    difference, 1% of lr; a wrong gradient moves the mean difference to ~lr."""
    exported = read_state_dict(folder)
    own = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied to the embedding
    assert set(exported) == set(own)
    for name, value in own.items():
        assert (exported[name] - value).abs().mean() <= 0.01 * lr, name


def _assert_same_metrics(got: dict, want: dict) -> None:
    """The same keys, None where the other is None, numbers within float summation noise."""
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == (None if value is None else pytest.approx(value, rel=1e-5, abs=1e-7)), key


def test_fsdp2_two_ranks_step_equals_single_process_and_resumes_from_sharded_checkpoint(tmp_path):
    ranks = _ranks_module()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    started = subprocess.run(
        [str(ROOT / ".venv/bin/torchrun"), "--standalone", "--nproc-per-node", "2", str(RANKS), str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert started.returncode == 0, started.stderr[-4000:]
    result = json.loads((tmp_path / "metrics.json").read_text())
    first, second = result["first"], result["second"]
    assert first["world_size"] == 2 and first["micro_batches"] == 3
    assert result["state"] == {"policy_version": 1}

    # The same two steps in one process.
    trainer = Trainer(ranks.config(), build_tiny_model(seed=0))
    alone_first = trainer.update(ranks.step_sequences(1))
    _assert_same_weights(trainer.model, tmp_path / "step1" / "model", ranks.LR)
    alone_second = trainer.update(ranks.step_sequences(2))
    _assert_same_weights(trainer.model, tmp_path / "step2" / "model", ranks.LR)

    for dist_metrics, alone in ((first, alone_first), (second, alone_second)):
        assert dist_metrics["loss"] == pytest.approx(alone["loss"], rel=1e-5, abs=1e-7)
        assert dist_metrics["grad_norm"] == pytest.approx(alone["grad_norm"], rel=1e-5)
        assert dist_metrics["grad_norm"] > ranks.config().max_grad_norm  # clipped by the global norm
        for key in ("tokens_trained", "tokens_processed", "micro_batches", "sequences"):
            assert dist_metrics[key] == alone[key], key
        # Alone, the zero-advantage micro-batch skips its backward; under FSDP it runs one
        # (with zero gradient) because rank 1 needs a backward at the same position.
        assert dist_metrics["micro_batches_zero_advantage"] <= alone["micro_batches_zero_advantage"]
        for key in ("logprob_gap_max_abs", "logprob_gap_mean_abs", "clip_fraction", "tis_weight_mean", "ratio_mean"):
            assert dist_metrics[key] == pytest.approx(alone[key], rel=1e-5, abs=1e-7), key
        # every rank's tokens in the quantiles and shares (gathered), not rank 0's alone
        _assert_same_metrics(dist_metrics["off_policy"], alone["off_policy"])
    # A mask under FSDP: the kept tokens of both ranks set every weight, as in one process.
    masked = result["masked"]
    alone_masked = Trainer(ranks.masked_config(), build_tiny_model(seed=0)).update(ranks.step_sequences(3))
    assert 0 < alone_masked["off_policy"]["tokens_masked_fraction"] < 1
    _assert_same_metrics(masked["off_policy"], alone_masked["off_policy"])
    assert masked["loss"] == pytest.approx(alone_masked["loss"], rel=1e-5, abs=1e-7)
    assert masked["grad_norm"] == pytest.approx(alone_masked["grad_norm"], rel=1e-5)
    assert alone_first["micro_batches_zero_advantage"] == 1
    # Sharded state (resumable) next to the one-file model the engines load.
    assert (tmp_path / "step1" / "sharded" / ".metadata").is_file()
    assert read_metadata(tmp_path / "step2" / "model") == {"policy_version": 2}
