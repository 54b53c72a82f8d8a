"""A training sequence's routed experts, gathered from the completions merged into it.

An MoE engine records, for each completion, the expert ids of its prompt and of every sampled
token but the last (int16 ``[P + S - 1, layers, top_k]``; the last sampled token never ran
through the model).  A chain (``app.training.trajectories``) needs one row per token,
``[T, layers, top_k]``, for routing replay (R3, Ma et al. 2025, arXiv:2510.11370).

The merging rule: positions already in the chain keep the routes recorded when they were
first computed (first writer wins: the earlier completion's rollout is what scored its
sampled tokens, and a prefix-cache hit returns those same routes); a completion that extends
the chain supplies the rows it adds: the previous completion's last sampled token (which
never ran through the model in that completion), the tokens in between (tool results,
template glue) and its own sampled tokens but the last.  The chain's last token gets a row of
-1 (``app.engines.route_bytes.UNROUTED``): nothing scored a logit from it.  A chain any of
whose completions lacks routes that fit (none recorded, a wrong length, another layer/top-k
shape) has no routes at all (None): the trainer never replays guessed experts.
"""
from __future__ import annotations

import numpy as np

from app.engines.route_bytes import unrouted


def fitting(routes: np.ndarray | None, tokens: int) -> np.ndarray | None:
    """``routes`` when they cover exactly ``tokens - 1`` positions (a completion's prompt and
    sampled tokens but the last: ``tokens`` = P + S) as ``[tokens - 1, layers, top_k]``, else None."""
    if routes is None or routes.ndim != 3 or len(routes) != tokens - 1:
        return None
    return routes


class ChainRoutes:
    """The rows of one chain's positions ``[0, length - 1)``, in token order.

    ``ChainRoutes(routes)`` with the first completion's fitting routes (or None);
    ``extend(routes, known)`` with the next completion's, ``known`` = the chain's length before
    it minus 1 (the positions whose rows the chain holds); ``close(length)`` the chain's
    ``[length, layers, top_k]`` routes, or None when a completion had none.
    """

    def __init__(self, routes: np.ndarray | None) -> None:
        self.parts: list[np.ndarray] | None = None if routes is None else [routes]

    def extend(self, routes: np.ndarray | None, known: int) -> None:
        if self.parts is None or routes is None or routes.shape[1:] != self.parts[0].shape[1:]:
            self.parts = None
        else:  # first writer wins: rows [0, known) stay as they were recorded
            self.parts.append(routes[known:])

    def close(self, length: int) -> np.ndarray | None:
        """Raises ValueError when the rows do not cover ``length - 1`` positions (a builder bug)."""
        if self.parts is None:
            return None
        _, layers, top_k = self.parts[0].shape
        routes = np.concatenate([*self.parts, unrouted(1, layers, top_k)], axis=0)
        if len(routes) != length:
            raise ValueError(f"chain routes cover {len(routes)} positions, the chain has {length} tokens")
        return routes


def routes_report(report: dict, any_routes: bool, routed: list[bool]) -> None:
    """Add ``routed_chains`` / ``unrouted_chains`` (one flag per chain) to a builder's report
    when any completion carried routes (an MoE policy)."""
    if any_routes:
        report.update(routed_chains=sum(routed), unrouted_chains=len(routed) - sum(routed))
