"""Prefix cache bookkeeping: longest-prefix lookup, LRU budget, redundancy, min hit."""
from __future__ import annotations

import torch

from app.engines.embedded.prefix_cache import PrefixCache


def kv(tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fake per-layer KV whose values encode the token ids (so crops can be checked)."""
    t = torch.tensor(tokens, dtype=torch.float32).view(1, 1, -1, 1)
    return [(t.clone(), -t.clone()) for _ in range(2)]


def test_longest_prefix_wins_and_last_prompt_token_is_left_to_compute():
    cache = PrefixCache(max_tokens=1000, min_hit=2)
    cache.store([1, 2, 3, 4], kv([1, 2, 3, 4]))
    cache.store([1, 2, 9, 9, 9], kv([1, 2, 9, 9, 9]))
    hit = cache.lookup([1, 2, 3, 4, 5, 6])
    assert hit.length == 4 and hit.layers[0][0].flatten().tolist() == [1, 2, 3, 4]
    assert cache.lookup([1, 2, 3, 4]).length == 3  # identical prompt: the last token is recomputed
    assert cache.lookup([7, 7, 7]) is None
    assert cache.lookup([1, 5, 5]) is None  # 1-token prefix is below min_hit


def test_budget_evicts_least_recently_used_and_prefixes_are_merged():
    cache = PrefixCache(max_tokens=10, min_hit=2)
    cache.store([1, 2, 3], kv([1, 2, 3]))
    cache.store([1, 2, 3, 4, 5], kv([1, 2, 3, 4, 5]))  # supersedes [1, 2, 3]
    assert len(cache) == 1
    cache.store([7, 8, 9, 10], kv([7, 8, 9, 10]))
    cache.lookup([1, 2, 3, 4, 5, 6])  # touch: [7..10] is now least recent
    cache.store([20, 21, 22], kv([20, 21, 22]))  # 5 + 4 + 3 > 10: evict [7..10]
    assert cache.lookup([7, 8, 9, 10, 11]) is None
    assert cache.lookup([1, 2, 3, 4, 5, 6]).length == 5
    cache.clear()
    assert cache.lookup([1, 2, 3, 4, 5, 6]) is None
