"""Admission: which waiting requests the next prefill takes.

In queue order, as many as the running limit allows and the prefill token budget holds (rows x
longest uncached suffix <= `max_prefill_tokens`; the first always fits). A request that shares
`IN_BATCH_PREFIX_MIN_TOKENS` uncached prefix tokens with one already taken waits one round and then
finds that prefix in the cache (SGLang's in-batch prefix caching does the same).
"""

from __future__ import annotations

from collections.abc import Iterable

from services.engine.prefix_cache import PrefixCache
from services.engine.request_state import RequestState

IN_BATCH_PREFIX_MIN_TOKENS = 32  # shared uncached prefix tokens that make a request wait a round

# A request admitted to prefill: (state, its tokens, tokens cached, the cached KV pieces).
Admitted = tuple[RequestState, list[int], int, list]


def select_prefill(
    waiting: Iterable[RequestState],
    free_rows: int,
    prefix_cache: PrefixCache,
    max_prefill_tokens: int,
) -> list[Admitted]:
    """The requests of `waiting` (in order) that the next prefill takes, with their prefix-cache
    hits; at most `free_rows`. Removes nothing from `waiting`."""
    group: list[Admitted] = []
    longest = 0
    for state in waiting:
        if len(group) >= free_rows:
            break
        tokens = state.tokens()
        cached, pieces = prefix_cache.match(tokens, len(tokens) - 1)
        if prefix_cache.enabled and any(
            _shared_prefix(tokens, other) >= cached + IN_BATCH_PREFIX_MIN_TOKENS
            for _, other, _, _ in group
        ):
            continue  # in-batch prefix caching: it will find that prefix cached after this prefill
        longest_if_added = max(longest, len(tokens) - cached)
        if group and longest_if_added * (len(group) + 1) > max_prefill_tokens:
            break
        group.append((state, tokens, cached, pieces))
        longest = longest_if_added
    return group


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
