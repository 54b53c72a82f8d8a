"""Routed experts through trajectory building: the merging rule, the -1 last row, all-or-nothing
chains, and storage on SQLite and PostgreSQL (decoded back exactly)."""
from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import select

from app.db import session_scope
from app.engines.route_bytes import from_bytes, to_bytes
from app.tables import Trajectory
from app.training.store import build_episode_trajectories
from app.training.trajectories import CompletionRecord, per_request, prefix_merging
from support.episodes import seed_episode

LAYERS, TOP_K = 2, 2


def routes_for(tokens: list[int], salt: int) -> np.ndarray:
    """Distinct expert ids per (token position, salt): [len(tokens) - 1, LAYERS, TOP_K] int16.
    Different salts give different rows for the same position, so a test can tell which
    completion supplied a row."""
    n = len(tokens) - 1
    base = (np.arange(n)[:, None, None] * 7 + salt * 3 + np.arange(LAYERS)[None, :, None]) % 8
    return np.concatenate([base, (base + 1) % 8], axis=2).astype(np.int16)


def record(seq: int, prompt: list[int], sampled: list[int], salt: int, routes="auto") -> CompletionRecord:
    r = routes_for(prompt + sampled, salt) if isinstance(routes, str) else routes
    return CompletionRecord(seq, prompt, sampled, [-0.5] * len(sampled), "stop", completion_id=100 + seq, routes=r)


P1, S1 = [1, 10, 11, 12], [20, 21, 2]
BETWEEN = [198, 30, 31, 198]
P2 = P1 + S1 + BETWEEN
S2 = [40, 41, 2]


def test_prefix_merging_first_writer_wins_and_the_last_row_is_minus_one():
    first, second = record(0, P1, S1, salt=1), record(1, P2, S2, salt=2)
    built = prefix_merging([first, second])
    (chain,) = built.sequences
    assert chain.token_ids == P2 + S2
    assert chain.routes.dtype == np.int16 and chain.routes.shape == (len(P2) + len(S2), LAYERS, TOP_K)
    known = len(P1) + len(S1) - 1  # positions the first completion ran through the model
    np.testing.assert_array_equal(chain.routes[:known], first.routes)  # first writer wins
    # From the previous completion's last sampled token on, the second completion's own rows.
    np.testing.assert_array_equal(chain.routes[known:-1], second.routes[known:])
    assert not np.array_equal(first.routes[:known], second.routes[:known])  # the test can tell them apart
    assert (chain.routes[-1] == -1).all() and (chain.routes[:-1] >= 0).all()
    assert (built.report["routed_chains"], built.report["unrouted_chains"]) == (1, 0)


def test_per_request_routes_are_the_completion_s_own_plus_a_minus_one_row():
    first, second = record(0, P1, S1, salt=1), record(1, P2, S2, salt=2)
    built = per_request([first, second])
    for seq, rec in zip(built.sequences, (first, second)):
        assert seq.routes.shape == (len(seq.token_ids), LAYERS, TOP_K)
        np.testing.assert_array_equal(seq.routes[:-1], rec.routes)
        assert (seq.routes[-1] == -1).all()
    assert built.report["routed_chains"] == 2


@pytest.mark.parametrize("bad", ["none", "short", "shape"])
def test_a_chain_with_a_completion_without_fitting_routes_has_none(bad):
    tokens = P2 + S2
    second_routes = {"none": None, "short": routes_for(tokens, 2)[:-1],
                     "shape": np.zeros((len(tokens) - 1, LAYERS, TOP_K + 1), dtype=np.int16)}[bad]
    built = prefix_merging([record(0, P1, S1, salt=1), record(1, P2, S2, salt=2, routes=second_routes)])
    (chain,) = built.sequences
    assert chain.routes is None
    assert (built.report["routed_chains"], built.report["unrouted_chains"]) == (0, 1)


def test_dense_records_have_no_routes_and_no_route_report():
    built = prefix_merging([record(0, P1, S1, 1, routes=None), record(1, P2, S2, 2, routes=None)])
    assert built.sequences[0].routes is None and "routed_chains" not in built.report


def test_a_cut_chain_keeps_its_own_routes():
    """A completion that extends no chain starts its own, with its own routes."""
    other_prompt = [1, 99, 98]
    built = prefix_merging([record(0, P1, S1, 1), record(1, other_prompt, [5, 2], 3)])
    assert len(built.sequences) == 2
    np.testing.assert_array_equal(built.sequences[1].routes[:-1], routes_for(other_prompt + [5, 2], 3))


@pytest.mark.parametrize("builder", ["prefix_merging", "per_request"])
def test_stored_trajectory_routes_decode_exactly(any_database, builder):
    r1, r2 = routes_for(P1 + S1, 1), routes_for(P2 + S2, 2)
    episode_id = seed_episode(
        [(P1, S1, [-0.5] * 3), (P2, S2, [-0.25] * 3)],
        extra=[{"routed_experts": to_bytes(r1), "route_shape": [LAYERS, TOP_K]},
               {"routed_experts": to_bytes(r2), "route_shape": [LAYERS, TOP_K]}])
    with session_scope() as s:
        _, report = build_episode_trajectories(s, episode_id, builder)
    with session_scope() as s:
        rows = s.scalars(select(Trajectory).where(Trajectory.episode_id == episode_id)
                         .order_by(Trajectory.chain_index)).all()
        for row in rows:
            assert row.meta["route_shape"] == [LAYERS, TOP_K]
            routes = from_bytes(row.routed_experts, LAYERS, TOP_K)
            assert len(routes) == len(row.token_ids) and (routes[-1] == -1).all()
        if builder == "prefix_merging":
            (row,) = rows
            routes = from_bytes(row.routed_experts, LAYERS, TOP_K)
            known = len(P1) + len(S1) - 1
            np.testing.assert_array_equal(routes[:known], r1)
            np.testing.assert_array_equal(routes[known:-1], r2[known:])
    assert report["routed_chains"] == len(rows)


def test_stored_routes_that_do_not_decode_leave_the_chain_without(database):
    episode_id = seed_episode([(P1, S1, [-0.5] * 3)],
                              extra=[{"routed_experts": b"\x01\x02\x03", "route_shape": [LAYERS, TOP_K]}])
    with session_scope() as s:
        rows, _ = build_episode_trajectories(s, episode_id, "prefix_merging")
        assert rows[0].routed_experts is None and "route_shape" not in rows[0].meta
