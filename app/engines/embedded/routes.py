"""Routed experts of the scheduler's forward passes, dealt to the rows that ran them.

An MoE model's routers see the flattened ``[batch × new tokens, hidden]`` input of each forward:
a prefill chunk of one row, or one token of every running row in a decode step.  ``RouteTap``
keeps persistent hooks on the routers and hands the last forward's expert ids to the rows in
that order, so each row accumulates the routes of exactly the tokens in its KV cache (a
prefix-cache hit supplies the stored routes of the cached tokens).
"""
from __future__ import annotations

import numpy as np
import torch

from app.engines.routing import ROUTE_DTYPE, moe_routers


class RouteTap:
    """Hooks on every router of ``model`` keeping the expert ids of its last forward (none if dense)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        self._last: list[torch.Tensor | None] = [None] * len(self.routers)
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def hook(_module, _inputs, output):
            self._last[layer] = output[2].detach()
        return hook

    def deal(self, targets: list[list[np.ndarray]]) -> None:
        """Split the last forward's ids ``[rows, layers, top_k]`` (int16) evenly over ``targets``
        (one list per batch row, in batch order) and append each row's block; no-op if dense."""
        if not self.routers:
            return
        ids = torch.stack([t for t in self._last], dim=1).to("cpu", torch.int16).numpy().astype(ROUTE_DTYPE)
        for target, block in zip(targets, np.split(ids, len(targets))):
            target.append(block)


def joined(blocks: list[np.ndarray]) -> np.ndarray | None:
    """The row's routes ``[tokens, layers, top_k]`` in token order, or None when it has none (dense)."""
    return np.concatenate(blocks, axis=0) if blocks else None


def routes_of(blocks: list[np.ndarray] | None, tokens: int) -> np.ndarray | None:
    """Routes ``[tokens, layers, top_k]`` of a request's first ``tokens`` tokens (prompt, then sampled).

    ``blocks`` is the scheduler's live list from a ``TokenEvent`` (it may already hold later
    tokens when the reader is behind; they are cut off).  A request's last sampled token never
    ran through the model, so ``tokens`` is at most ``prompt + completion - 1``.  None if dense.

    Raises:
        ValueError: fewer than ``tokens`` tokens have routes (a row that lost its routes).
    """
    if blocks is None:
        return None
    routes = joined(list(blocks))
    have = 0 if routes is None else routes.shape[0]
    if have < tokens:
        raise ValueError(f"routes of {have} tokens recorded, {tokens} needed")
    return routes[:tokens]
