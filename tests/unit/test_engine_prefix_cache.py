"""The engine's radix prefix cache: longest-prefix match, edge splits, LRU eviction, stale inserts."""

from __future__ import annotations

import torch

from services.engine.prefix_cache import PrefixCache


def kv_for(tokens: list[int]) -> torch.Tensor:
    """Fake KV [layers=1, 2, heads=1, n, dim=1] whose values are the token ids (easy to check)."""
    values = torch.tensor(tokens, dtype=torch.float32)
    return values.view(1, 1, 1, -1, 1).expand(1, 2, 1, -1, 1).contiguous()


def joined(pieces: list[torch.Tensor]) -> list[int]:
    return torch.cat(pieces, dim=3)[0, 0, 0, :, 0].long().tolist() if pieces else []


def test_match_returns_the_longest_cached_prefix_across_split_edges():
    cache = PrefixCache(max_bytes=1 << 20)
    cache.insert([1, 2, 3, 4, 5], kv_for([1, 2, 3, 4, 5]), cache.generation)
    cache.insert([1, 2, 3, 9], kv_for([9]), cache.generation)  # shares [1, 2, 3]: splits the edge
    n, pieces = cache.match([1, 2, 3, 9, 7], max_tokens=4)
    assert n == 4 and joined(pieces) == [1, 2, 3, 9]
    n, pieces = cache.match([1, 2, 3, 4, 5, 6], max_tokens=5)
    assert n == 5 and joined(pieces) == [1, 2, 3, 4, 5]
    n, pieces = cache.match([1, 2, 8], max_tokens=2)
    assert n == 2 and joined(pieces) == [1, 2]
    assert cache.match([7, 1], max_tokens=1) == (0, [])


def test_stale_generation_inserts_are_ignored_after_clear():
    cache = PrefixCache(max_bytes=1 << 20)
    old = cache.generation
    cache.clear()
    cache.insert([1, 2, 3], kv_for([1, 2, 3]), old)
    assert cache.match([1, 2, 3, 4], max_tokens=3) == (0, []) and cache.bytes == 0


def test_least_recently_used_leaves_are_evicted_over_the_budget():
    one_sequence = kv_for([0] * 4).numel() * 4
    cache = PrefixCache(max_bytes=2 * one_sequence)
    cache.insert([1, 1, 1, 1], kv_for([1] * 4), cache.generation)
    cache.insert([2, 2, 2, 2], kv_for([2] * 4), cache.generation)
    cache.match([1, 1, 1, 1, 0], max_tokens=4)  # touch the first
    cache.insert([3, 3, 3, 3], kv_for([3] * 4), cache.generation)
    assert cache.bytes <= 2 * one_sequence
    assert cache.match([2, 2, 2, 2, 0], max_tokens=4)[0] == 0
    assert cache.match([1, 1, 1, 1, 0], max_tokens=4)[0] == 4


def test_a_disabled_cache_never_matches():
    cache = PrefixCache(max_bytes=1 << 20, enabled=False)
    cache.insert([1, 2], kv_for([1, 2]), cache.generation)
    assert cache.match([1, 2, 3], max_tokens=2) == (0, [])
