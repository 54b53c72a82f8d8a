"""Prefix cache of the embedded engine: reuse the KV cache of earlier sequences.

An agent's calls re-send the whole conversation, so turn k+1's prompt starts with turn k's
prompt (and usually its completion).  When a request finishes, the scheduler stores the KV
tensors of its tokens here; a new request whose prompt shares a prefix with a stored
sequence starts its prefill after that prefix (the idea of vLLM's automatic prefix
caching, https://docs.vllm.ai/en/latest/design/prefix_caching.html, without block paging:
whole sequences, LRU by total tokens).  The gateway's session-affine routing makes hits
likely.  Entries are dropped on weight reload (KV computed by old weights is invalid).
Entries live in namespaces: KV computed under a LoRA adapter is keyed by that adapter's
(name, version), base-model KV by None, so a prompt never reuses KV of another adapter or of
an older version of its own.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each [1, kv_heads, T, head_dim]


@dataclass(frozen=True)
class PrefixHit:
    length: int      # prompt tokens whose KV is reused
    layers: Layers   # KV of exactly those tokens
    routes: np.ndarray | None = None  # MoE: routed experts [length, layers, top_k] of those tokens


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """LRU of ``tokens → KV`` holding at most ``max_tokens`` tokens in total (0 disables it).

    Args:
        max_tokens: budget; SmolLM2-135M costs 46 KB per token in fp32.
        min_hit: shortest prefix worth reusing (shorter hits are ignored).
    """

    def __init__(self, max_tokens: int = 16384, min_hit: int = 16) -> None:
        self.max_tokens = max_tokens
        self.min_hit = min_hit
        # (namespace, tokens) -> (KV, routes): an MoE hit must hand back the cached tokens' routes.
        self._entries: OrderedDict[tuple, tuple[Layers, np.ndarray | None]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return len(self._entries)

    def store(self, tokens: list[int], layers: Layers, namespace=None, routes: np.ndarray | None = None) -> None:
        """Keep ``layers`` (KV of exactly ``tokens``, computed under ``namespace``: None for the
        base model, an adapter's (name, version)); the caller passes tensors it no longer mutates.
        ``routes``: an MoE model's expert ids ``[len(tokens), layers, top_k]`` of those tokens."""
        key = tuple(tokens)
        if not self.max_tokens or len(key) > self.max_tokens or len(key) < self.min_hit:
            return
        if (namespace, key) in self._entries:
            self._entries.move_to_end((namespace, key))
            return
        # An entry of the same namespace that is a prefix of the new one is redundant.
        for old in [k for k in self._entries if k[0] == namespace and len(k[1]) <= len(key) and key[: len(k[1])] == k[1]]:
            self._size -= len(old[1])
            del self._entries[old]
        self._entries[(namespace, key)] = (layers, routes)
        self._size += len(key)
        while self._size > self.max_tokens:
            old, _ = self._entries.popitem(last=False)
            self._size -= len(old[1])

    def lookup(self, prompt: list[int], namespace=None) -> PrefixHit | None:
        """Longest stored prefix of ``prompt`` computed under ``namespace`` (at most
        ``len(prompt) - 1`` tokens: the last prompt token must still go through the model to
        produce the first logits)."""
        best_key, best = None, 0
        for key in self._entries:
            if key[0] != namespace:
                continue
            length = min(_common_prefix(key[1], prompt), len(prompt) - 1)
            if length > best:
                best_key, best = key, length
        if best_key is None or best < self.min_hit:
            return None
        self._entries.move_to_end(best_key)
        kv, routes = self._entries[best_key]
        layers = [(k[:, :, :best], v[:, :, :best]) for k, v in kv]
        return PrefixHit(best, layers, None if routes is None else routes[:best])

    def clear(self) -> None:
        self._entries.clear()
        self._size = 0
