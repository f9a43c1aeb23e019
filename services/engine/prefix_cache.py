"""Prefix cache: KV of token-id prefixes already computed, in a radix tree (as SGLang's RadixAttention).

Every episode starts with the same system prompt and examples, and every turn of an episode
extends the previous turn's tokens, so a new request usually shares a long prefix with something
computed before. Keys are token ids; an edge holds a run of ids and their KV
[layers, 2, kv_heads, n, head_dim]. Because attention is causal and positions are absolute, the KV of
the first k tokens of any cached sequence is exactly the KV of those k tokens in a new request.

Bounded by `max_bytes`: least-recently-used leaves are evicted first. `clear()` drops everything
and bumps `generation`; KV computed before a clear (old weights) must not be inserted after it, so
callers pass the generation they read at compute time and stale inserts are ignored.
"""

from __future__ import annotations

import itertools

import torch


class _Node:
    __slots__ = ("tokens", "kv", "children", "parent", "last_used")

    def __init__(
        self, tokens: tuple[int, ...], kv: torch.Tensor | None, parent: _Node | None
    ) -> None:
        self.tokens, self.kv, self.parent = tokens, kv, parent
        self.children: dict[int, _Node] = {}
        self.last_used = 0


class PrefixCache:
    """Radix tree of token ids -> KV. Not thread-safe: used by the scheduler thread only."""

    def __init__(self, max_bytes: int, enabled: bool = True) -> None:
        self.max_bytes, self.enabled = max_bytes, enabled
        self.generation = 0
        self._clock = itertools.count(1)
        self.clear()

    def clear(self) -> None:
        self._root = _Node((), None, None)
        self.bytes = 0
        self.tokens = 0
        self.generation = getattr(self, "generation", 0) + 1

    def match(self, tokens: list[int], max_tokens: int) -> tuple[int, list[torch.Tensor]]:
        """Longest cached prefix of `tokens`, at most `max_tokens` long.

        Returns (n, pieces): the KV pieces, in order, cover exactly tokens[:n] along dim 3.
        """
        if not self.enabled:
            return 0, []
        node, matched, pieces, now = self._root, 0, [], next(self._clock)
        while matched < max_tokens:
            child = node.children.get(tokens[matched]) if matched < len(tokens) else None
            if child is None:
                break
            common = _common_length(child.tokens, tokens, matched, max_tokens - matched)
            pieces.append(child.kv if common == len(child.tokens) else child.kv[:, :, :, :common])
            child.last_used = now
            matched += common
            if common < len(child.tokens):
                break
            node = child
        return matched, pieces

    def insert(self, tokens: list[int], kv_tail: torch.Tensor, generation: int) -> None:
        """Cache tokens whose last `kv_tail.shape[3]` KV entries are given (the rest must be cached
        already, as returned by `match`). Ignored when `generation` is stale or the prefix is gone."""
        if not self.enabled or generation != self.generation or not tokens:
            return
        start = len(tokens) - kv_tail.shape[3]
        node, position, now = self._root, 0, next(self._clock)
        while position < len(tokens):
            child = node.children.get(tokens[position])
            if child is None:
                if (
                    position < start
                ):  # part of the prefix was evicted meanwhile: nothing to attach to
                    return
                piece = kv_tail[:, :, :, position - start :].clone()
                leaf = _Node(tuple(tokens[position:]), piece, node)
                leaf.last_used = now
                node.children[tokens[position]] = leaf
                self._account(leaf, +1)
                break
            common = _common_length(child.tokens, tokens, position, len(tokens) - position)
            if common < len(child.tokens):
                self._split(child, common)
            child.last_used = now
            node, position = child, position + common
        self._evict()

    def _split(self, node: _Node, at: int) -> None:
        """Cut `node`'s edge after `at` tokens: node keeps the head, a new child gets the tail."""
        tail = _Node(node.tokens[at:], node.kv[:, :, :, at:], node)
        tail.children, tail.last_used = node.children, node.last_used
        for grandchild in tail.children.values():
            grandchild.parent = tail
        node.tokens, node.kv, node.children = (
            node.tokens[:at],
            node.kv[:, :, :, :at],
            {tail.tokens[0]: tail},
        )

    def _account(self, node: _Node, sign: int) -> None:
        self.bytes += sign * node.kv.numel() * node.kv.element_size()
        self.tokens += sign * len(node.tokens)

    def _evict(self) -> None:
        while self.bytes > self.max_bytes:
            leaves = [n for n in self._walk() if not n.children]
            if not leaves:
                return
            victim = min(leaves, key=lambda n: n.last_used)
            del victim.parent.children[victim.tokens[0]]
            self._account(victim, -1)

    def _walk(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _common_length(edge: tuple[int, ...], tokens: list[int], offset: int, limit: int) -> int:
    n = min(len(edge), limit, len(tokens) - offset)
    for i in range(n):
        if edge[i] != tokens[offset + i]:
            return i
    return n
