"""A routing-replay step's data on SQLite: chains stored with routes carry them to the trainer,
a chain recorded without routes is left out and counted (never trained unreplayed)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from app.db import session_scope
from app.engines.modeling import load_model
from app.engines.routing import encode_routes, score_completion
from app.runconfig import TrainingConfig
from app.training import steps
from app.training.store import build_episode_trajectories
from app.training.trainer import Trainer

VOCAB = 49152


def test_chains_without_routes_are_left_out_and_counted(var_dir, data):
    model, _tok = load_model("tiny-moe")
    run_id = data.run(["http://127.0.0.1:9"], {"routing_replay": True})
    episodes = data.group(run_id, 0, [1.0, 0.0], seed=1)
    with session_scope() as s:  # episode 0's chain as the gateway stores it for an MoE policy
        (row,), _report = build_episode_trajectories(s, episodes[0], "prefix_merging", VOCAB)
        with torch.no_grad():
            _lp, routes = score_completion(model, row.token_ids, 1)
        chain = np.concatenate([routes, np.full((1, 2, 2), -1, dtype=np.int16)])
        row.routed_experts = encode_routes(chain)
        row.meta = {**row.meta, "route_shape": [2, 2]}
    config = TrainingConfig(routing_replay=True, learning_rate=1e-3, micro_batch_tokens=1024)
    sequences, metrics = steps.step_sequences(run_id, episodes, config, VOCAB)
    assert [s.episode_id for s in sequences] == [episodes[0]]
    assert np.array_equal(sequences[0].routes, chain) and sequences[0].routes.dtype == np.int16
    merge = metrics["merge"]
    assert merge["sequences_no_routes"] == 1
    assert merge["rejected_reasons"][steps.NO_ROUTES] == 3  # the 3 completions merged into episode 1's chain
    # The kept chain trains with its routes replayed: same weights, so the live router agrees.
    step = Trainer(config, model).update(sequences)
    assert step["sequences"] == 1
    assert step["routing_replay"]["tokens_compared"] == len(chain) - 1
    assert step["routing_replay"]["route_mismatch_fraction"] == 0.0
    # Replay off: both chains train, without routes.
    plain, plain_metrics = steps.step_sequences(run_id, episodes, TrainingConfig(), VOCAB)
    assert len(plain) == 2 and all(s.routes is None for s in plain)
    assert "sequences_no_routes" not in plain_metrics["merge"]


def test_routes_that_do_not_fit_the_chain_are_refused_naming_the_trajectory(var_dir, data):
    run_id = data.run(["http://127.0.0.1:9"], {"routing_replay": True})
    episodes = data.group(run_id, 0, [1.0, 0.0], seed=2)
    with session_scope() as s:
        (row,), _report = build_episode_trajectories(s, episodes[0], "prefix_merging", VOCAB)
        row.routed_experts = encode_routes(np.zeros((len(row.token_ids) - 4, 2, 2), dtype=np.int16))
        row.meta = {**row.meta, "route_shape": [2, 2]}
        trajectory_id = row.id
    with pytest.raises(ValueError, match=f"trajectory {trajectory_id}: routes of"):
        steps.step_sequences(run_id, episodes, TrainingConfig(routing_replay=True), VOCAB)
