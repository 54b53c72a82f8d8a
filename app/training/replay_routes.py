"""A stored chain's routed experts as the trainer replays them (`TrainingConfig.routing_replay`).

`Trajectory.routed_experts` holds a chain's expert ids, int16 `[T, layers, top_k]` as
`app.engines.route_bytes.to_bytes` bytes, -1 at the last token; `meta["route_shape"]` is
`[layers, top_k]`.  A routing-replay step trains only chains that have them: one without is
left out under the reason `NO_ROUTES` (`app.training.steps.step_sequences` counts it).
"""
from __future__ import annotations

from app.engines.route_bytes import from_bytes

NO_ROUTES = "no routed experts"  # merge.rejected_reasons: a chain left out of a routing-replay step


def trajectory_routes(row):
    """The chain routes of Trajectory `row`, int16 numpy [T, layers, top_k] (-1 at the last token),
    or None when it was recorded without them (a dense model, or an engine that returned none).
    Raises ValueError when the bytes do not fit `meta.route_shape` or the token count."""
    if row.routed_experts is None:
        return None
    shape = (row.meta or {}).get("route_shape")
    if not shape or len(shape) != 2:
        raise ValueError(f"trajectory {row.id}: routed_experts stored without meta.route_shape [layers, top_k]")
    routes = from_bytes(row.routed_experts, int(shape[0]), int(shape[1]))
    if len(routes) != len(row.token_ids):
        raise ValueError(f"trajectory {row.id}: routes of {len(routes)} tokens for {len(row.token_ids)} tokens")
    return routes
