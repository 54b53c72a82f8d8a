"""What the embedded engine's scheduler is given and what it sends back, one request at a time.

A caller builds a ``GenerationRequest`` (prompt token ids, a token limit, sampling parameters,
stop ids, optionally a LoRA adapter) and submits it to ``app.engines.embedded.batching.
BatchScheduler``.  Events put on ``GenerationRequest.events`` (a ``queue.Queue``), in order:
``Started(policy_version)``, then one ``TokenEvent`` per generated token (the last one has
``finish_reason`` set), ``Aborted`` after a reload in mode ``abort``, or ``Failed(message)`` at
any point after an internal error.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any

from app.engines.embedded import adapters
from app.engines.embedded.sampling import SamplingParams, TokenSample


@dataclass(frozen=True)
class Started:
    """The request left the queue; its tokens are sampled by weights of ``policy_version``."""

    policy_version: int


@dataclass(frozen=True)
class TokenEvent:
    """One generated token (``sample``: its id and logprobs); ``finish_reason`` set on the last."""

    sample: TokenSample
    finish_reason: str | None = None   # "stop" | "length" | None while running
    stop_token_id: int | None = None   # the stop token that ended generation (vLLM's stop_reason)
    policy_version: int | None = None  # version of the weights that sampled this token
    kv_version: int | None = None      # oldest version of the KV this token attended to (< policy_version
                                       # only after a `keep` update without recompute_kv)
    routes: Any = None                 # MoE: the row's growing list of route blocks; read it with
                                       # app.engines.embedded.routes.routes_of (None: dense model)


@dataclass(frozen=True)
class Aborted:
    """The request was ended by a weight update in mode ``abort``; its sampled tokens stand."""

    policy_version: int


@dataclass(frozen=True)
class Failed:
    """The request ended after an internal error of the engine (``message`` says which)."""

    message: str


@dataclass(eq=False)
class GenerationRequest:
    """Token-level work item.  ``max_tokens`` ≥ 1; ``stop_token_ids`` end generation when sampled."""

    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    policy_version: int | None = None
    adapter: adapters.Adapter | None = None  # a LoRA adapter on the base model (None: the base model)

    @property
    def cache_key(self) -> tuple[str, int] | None:
        """The prefix-cache namespace of this request's KV: its adapter's (name, version), or None."""
        return self.adapter.cache_key if self.adapter is not None else None

    def cancel(self) -> None:
        """Ask the scheduler to drop this request at the next step (client gone, stop string hit)."""
        self.cancelled.set()
