"""Routed experts as data, without torch: the engine answer's list, the stored bytes, the chain's rows.

An MoE engine asked for ``return_routed_experts`` answers with ``routed_experts``, a JSON list
``[tokens][layers][top_k]`` of expert ids for the prompt and every sampled token but the last
(the embedded engine's field; ``app.engines.routed`` rewrites vLLM's answer to it).  The gateway
and trajectory building hold them as int16 numpy arrays ``[tokens, layers, top_k]`` and store
them as little-endian int16 bytes, ``2 * layers * top_k`` bytes per token.  This is the one
codec (``app.engines.routing.encode_routes`` / ``decode_routes`` are its names beside torch's
hooks); the gateway and the trajectory builders import this module and never torch.
A row of ``UNROUTED`` (-1) stands for a token that ran through no forward whose output is
scored: a chain's last token.
"""
from __future__ import annotations

import numpy as np

ROUTE_DTYPE = np.int16
UNROUTED = -1
_WIRE = np.dtype("<i2")


def routes_from_answer(value: object) -> np.ndarray:
    """An engine answer's ``routed_experts`` -> int16 ``[tokens, layers, top_k]``.

    Raises:
        ValueError: not a 3-D list of integers, or an id outside ``[0, 32767]``.
    """
    try:
        array = np.asarray(value)
    except ValueError as exc:  # ragged lists
        raise ValueError(f"routed_experts is not a [tokens][layers][top_k] list: {exc}") from exc
    if array.ndim != 3 or 0 in array.shape[1:] or (array.size and array.dtype.kind not in "iu"):
        raise ValueError(f"routed_experts must be integer [tokens, layers, top_k]; got {array.dtype} "
                         f"{tuple(array.shape)}")
    if array.size and (int(array.min()) < 0 or int(array.max()) > np.iinfo(ROUTE_DTYPE).max):
        raise ValueError(f"routed_experts holds an expert id outside [0, {np.iinfo(ROUTE_DTYPE).max}]")
    return array.astype(ROUTE_DTYPE)


def to_bytes(routes: np.ndarray) -> bytes:
    """Little-endian int16 bytes of ``[tokens, layers, top_k]`` routes, row-major."""
    return np.ascontiguousarray(routes, dtype=_WIRE).tobytes()


def from_bytes(data: bytes, layers: int, top_k: int) -> np.ndarray:
    """Inverse of ``to_bytes``: int16 ``[tokens, layers, top_k]`` (a writable copy).

    Raises:
        ValueError: ``layers`` or ``top_k`` below 1, or ``len(data)`` not a whole number of tokens.
    """
    if layers < 1 or top_k < 1:
        raise ValueError(f"route shape [{layers}, {top_k}]: layers and top_k must be >= 1")
    per_token = 2 * layers * top_k
    if len(data) % per_token:
        raise ValueError(f"routes bytes {len(data)} not a multiple of {per_token} per token")
    return np.frombuffer(data, dtype=_WIRE).reshape(-1, layers, top_k).astype(ROUTE_DTYPE)


def unrouted(rows: int, layers: int, top_k: int) -> np.ndarray:
    """``rows`` rows of ``UNROUTED``: int16 ``[rows, layers, top_k]``."""
    return np.full((rows, layers, top_k), UNROUTED, dtype=ROUTE_DTYPE)
