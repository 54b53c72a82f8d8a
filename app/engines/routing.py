"""Routed experts of a mixture-of-experts model: record them in one forward, replay them in another.

A sparse MoE layer sends each token to the ``top_k`` experts with the largest router
probabilities (softmax of ``router_logits = hidden @ W_router.T``; Qwen3-MoE then renormalises
the chosen ``top_k`` probabilities to sum to 1, ``norm_topk_prob``).  An engine and a trainer
that run the same weights can still choose different experts for a token (different kernels,
batch shapes, dtypes), and then the trainer's logprobs are of another function than the one
that sampled.  Routing replay ("R3", Ma et al. 2025, *Stabilizing MoE Reinforcement Learning
by Aligning Training and Inference Routers*, arXiv:2510.11370) records the engine's expert ids
per token and layer and forces them in the trainer's forward.  The gate weights of the forced
experts are still computed from the live router logits, so the router keeps its gradient.

Routes are an int16 array ``[tokens, layers, top_k]`` (expert ids, MoE layers in model order);
``encode_routes`` stores them as little-endian int16 bytes: ``2 * layers * top_k`` bytes per
token (8 B for the tiny MoE, 768 B for Qwen3-30B-A3B's 48 layers × top-8).

Hooks sit on each layer's router module (``Qwen3MoeTopKRouter`` in transformers 5: returns
``(router_logits, gate_weights, expert_ids)`` for the flattened ``[rows, hidden]`` input).
A replay hook substitutes a fixed tensor, so activation checkpointing's recompute of a layer
gets the very same experts as the first pass.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from app.engines import route_bytes

ROUTE_DTYPE = route_bytes.ROUTE_DTYPE


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router module of every sparse MoE layer of ``model``, in layer order.

    A router is a module with ``top_k``, ``num_experts`` and a 2-D ``weight`` of shape
    ``[num_experts, hidden]`` (works through PEFT wrappers, which keep module names).
    Returns ``[]`` for a dense model.
    """
    return [m for _, m in model.named_modules()
            if hasattr(m, "top_k") and hasattr(m, "num_experts") and isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dim() == 2 and m.weight.shape[0] == m.num_experts]


def route_shape(model: nn.Module) -> tuple[int, int, int] | None:
    """``(moe_layers, top_k, num_experts)`` of ``model``, or ``None`` for a dense model.

    Raises:
        ValueError: the MoE layers disagree on ``top_k`` or ``num_experts``.
    """
    routers = moe_routers(model)
    if not routers:
        return None
    shapes = {(int(r.top_k), int(r.num_experts)) for r in routers}
    if len(shapes) != 1:
        raise ValueError(f"MoE layers differ in (top_k, num_experts): {sorted(shapes)}")
    top_k, experts = shapes.pop()
    return len(routers), top_k, experts


def gate_weights(router: nn.Module, router_logits: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
    """Gate weights of the given experts from live router logits (differentiable in the logits).

    ``softmax(router_logits)`` (fp32) gathered at ``expert_ids`` ``[rows, top_k]``, renormalised
    over the ``top_k`` when the router's ``norm_topk_prob`` is set, cast to the logits' dtype:
    the router's own formula, at forced experts.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights = probs.gather(-1, expert_ids)
    if getattr(router, "norm_topk_prob", False):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype)


@contextlib.contextmanager
def record_routes(model: nn.Module) -> Iterator[list[list[torch.Tensor]]]:
    """Record the expert ids every router of ``model`` chooses while the block runs.

    Yields ``calls``: one list per MoE layer, with the ``[rows, top_k]`` ids of each forward
    call in order (``rows`` = batch × new tokens of that call).  ``stack_routes(calls)``
    turns a batch-of-one recording (prefill + decode steps) into ``[tokens, layers, top_k]``.
    """
    routers = moe_routers(model)
    calls: list[list[torch.Tensor]] = [[] for _ in routers]
    handles = []
    for layer, router in enumerate(routers):
        def hook(_module, _inputs, output, layer=layer):
            calls[layer].append(output[2].detach().to("cpu", torch.int16))
        handles.append(router.register_forward_hook(hook))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def stack_routes(calls: list[list[torch.Tensor]]) -> np.ndarray:
    """``[tokens, layers, top_k]`` int16 from ``record_routes``' calls (tokens of all calls in order)."""
    if not calls:
        return np.zeros((0, 0, 0), dtype=ROUTE_DTYPE)
    per_layer = [torch.cat(layer_calls, dim=0) for layer_calls in calls]
    return torch.stack(per_layer, dim=1).numpy().astype(ROUTE_DTYPE, copy=False)


class RouteReplay:
    """Force every MoE layer of ``model`` to given expert ids (context manager).

    ``set(routes)`` with ``routes`` ``[rows, layers, top_k]`` (int, ``rows`` = batch × sequence
    of the next forward, row-major as the router flattens it) before each forward.  Each router
    still computes its logits; its output ids are replaced by the forced ones and its gate
    weights recomputed at them (``gate_weights``), so the router weight gets gradients; hooks
    entered before or after (``record_routes``) see the forced ids.  The
    forced tensor stays until the next ``set``, so a checkpointed layer's recompute replays
    the same experts.

    `set(routes, recorded)` with ``recorded`` bool ``[rows]`` (the rows whose routes were
    recorded, not filler) also counts, per layer, the recorded rows whose forced expert set
    differs from the one the live router would have chosen (once per ``set``: a checkpoint
    recompute is not counted twice); ``mismatch()`` reads the counts.

    Raises (from the hook, during forward):
        ValueError: no routes set, or their rows differ from the layer's input rows.
    """

    def __init__(self, model: nn.Module):
        self.routers = moe_routers(model)
        self.routes: torch.Tensor | None = None
        self.recorded: torch.Tensor | None = None
        self._counted: set[int] = set()
        self.differ = [0] * len(self.routers)  # recorded rows whose free routing differs, per layer
        self.compared = [0] * len(self.routers)
        self._handles: list = []

    def set(self, routes: np.ndarray | torch.Tensor, recorded: torch.Tensor | None = None) -> None:
        routes = torch.as_tensor(routes)
        if routes.dim() != 3 or routes.shape[1] != len(self.routers):
            raise ValueError(f"routes must be [rows, {len(self.routers)} layers, top_k]; got {tuple(routes.shape)}")
        if recorded is not None and tuple(recorded.shape) != (routes.shape[0],):
            raise ValueError(f"recorded must be [{routes.shape[0]}] rows; got {tuple(recorded.shape)}")
        self.routes = routes.to(torch.long)
        self.recorded = recorded
        self._counted = set()

    def mismatch(self) -> tuple[list[int], list[int]]:
        """``(differ, compared)`` per MoE layer since construction: recorded rows whose forced
        expert set differs from the live router's own top-k, and recorded rows seen."""
        return list(self.differ), list(self.compared)

    def _count(self, layer: int, own: torch.Tensor, forced: torch.Tensor) -> None:
        if self.recorded is None or layer in self._counted:
            return
        self._counted.add(layer)
        keep = self.recorded.to(own.device)
        same = (own.sort(dim=-1).values == forced.sort(dim=-1).values).all(dim=-1)
        self.differ[layer] += int((~same & keep).sum())
        self.compared[layer] += int(keep.sum())

    def _hook(self, layer: int):
        def hook(router, _inputs, output):
            logits = output[0]
            if self.routes is None:
                raise ValueError("routing replay: no routes set for this forward")
            if self.routes.shape[0] != logits.shape[0]:
                raise ValueError(f"routing replay: layer {layer} has {logits.shape[0]} rows, routes have {self.routes.shape[0]}")
            ids = self.routes[:, layer, :].to(logits.device)
            self._count(layer, output[2].detach(), ids)
            return logits, gate_weights(router, logits, ids), ids
        return hook

    def __enter__(self) -> RouteReplay:
        # prepend: the forced ids replace the output before any other hook (a recorder) sees it.
        self._handles = [r.register_forward_hook(self._hook(i), prepend=True) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def check_routes(routes: np.ndarray | None, tokens: int, shape: tuple[int, int, int], name: str) -> None:
    """Refuse routes that cannot be replayed, naming ``name`` (a chain or completion id).

    ``shape`` is ``route_shape(model)``.  Raises ``ValueError`` for missing routes, a token
    count other than ``tokens``, a layer/top-k shape other than the model's, an expert id
    outside ``[0, num_experts)``, or one expert twice among a token's top-k.
    """
    layers, top_k, experts = shape
    if routes is None:
        raise ValueError(f"{name}: routes missing")
    if routes.shape != (tokens, layers, top_k):
        raise ValueError(f"{name}: routes shape {tuple(routes.shape)} != ({tokens}, {layers}, {top_k})")
    if routes.size and (routes.min() < 0 or routes.max() >= experts):
        raise ValueError(f"{name}: expert id out of range [0, {experts})")
    if top_k > 1 and routes.size:
        ordered = np.sort(routes, axis=-1)
        if (ordered[..., 1:] == ordered[..., :-1]).any():
            raise ValueError(f"{name}: duplicate expert in a token's top-{top_k}")


# The stored bytes have one codec, torch-free, shared with the gateway and trajectory building.
encode_routes = route_bytes.to_bytes
decode_routes = route_bytes.from_bytes


def concat_routes(parts: list[np.ndarray]) -> np.ndarray:
    """Routes of consecutive token spans joined (prefix merging and splicing keep token order)."""
    return np.concatenate(parts, axis=0) if parts else np.zeros((0, 0, 0), dtype=ROUTE_DTYPE)


def score_completion(model: nn.Module, tokens: list[int] | torch.Tensor, prompt_len: int,
                     routes: np.ndarray | None = None) -> tuple[torch.Tensor, np.ndarray | None]:
    """The trainer's view of one sample: logprobs of its completion tokens in one forward.

    ``tokens`` is prompt + completion (``prompt_len`` prompt tokens, at least one completion
    token).  The forward runs over all tokens but the last, whose logit scores nothing: exactly
    the tokens an engine returns routes for (``prompt + completion - 1``).  With ``routes``
    ``[len(tokens) - 1, layers, top_k]`` the experts are forced (``RouteReplay``).  Gradients
    flow when the caller has them enabled.

    Returns ``(logprobs, seen)``: fp32 ``[completion]`` logprobs of ``tokens[prompt_len:]``
    (log-softmax of the logits), and the ``[len(tokens) - 1, layers, top_k]`` routes the forward
    ran (``None`` for a dense model).

    Raises:
        ValueError: no completion token, or ``routes`` of another shape (from ``RouteReplay``).
    """
    ids = torch.as_tensor(tokens, dtype=torch.long).view(1, -1)
    if not 0 < prompt_len < ids.shape[1]:
        raise ValueError(f"prompt_len {prompt_len} must leave at least one of {ids.shape[1]} tokens to score")
    inputs = ids[:, :-1]
    with record_routes(model) as calls, contextlib.ExitStack() as stack:
        if routes is not None:
            stack.enter_context(RouteReplay(model)).set(routes)
        logits = model(inputs).logits
    logp = torch.log_softmax(logits[0, prompt_len - 1:].float(), dim=-1)
    chosen = logp.gather(-1, ids[0, prompt_len:, None])[:, 0]
    return chosen, (stack_routes(calls) if calls else None)
