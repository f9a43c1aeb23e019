"""Sampling of the next token and its behavior log-prob, with SGLang's semantics.

Source: sglang `python/sglang/srt/layers/sampler.py:Sampler.forward` (docs/sglang.md):
* the returned log-prob is `log_softmax(logits / temperature)` of the sampled token over the full
  vocabulary, taken before top-k / top-p / min-p truncation (which only shapes the distribution
  the token is drawn from);
* temperature below 1e-6 means greedy: argmax, and the log-prob of the raw distribution
  `log_softmax(logits)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-6


@dataclass(frozen=True)
class SamplingSpec:
    """The sampling part of a request's `sampling_params`, validated."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or >= vocabulary: no top-k
    min_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def sample_next(
    logits: torch.Tensor, specs: list[SamplingSpec], generators: list[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token and its log-prob for each row.

    logits: [B, V] float32. specs, generators: one per row (a generator makes a row's draws depend
    only on its own seed, not on the batch). Returns (tokens [B] int64, logprobs [B] float32).
    Greedy rows take the argmax; unseeded rows are drawn together (one truncation and one
    multinomial over all of them, each row from its own softmax(logits / T) after its own top-k,
    top-p and min-p); seeded rows one by one from their generators.
    """
    device = logits.device
    temperatures = torch.tensor(
        [1.0 if s.greedy else s.temperature for s in specs], dtype=logits.dtype, device=device
    )
    logprobs_all = torch.log_softmax(logits / temperatures[:, None], dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    drawn = [row for row, s in enumerate(specs) if not s.greedy and generators[row] is None]
    if drawn:
        index = torch.tensor(drawn, dtype=torch.long, device=device)
        probs = _truncated_probs_rows(
            logprobs_all.index_select(0, index), [specs[r] for r in drawn]
        )
        tokens.index_copy_(0, index, torch.multinomial(probs, 1).squeeze(1))
    for row, (spec, generator) in enumerate(zip(specs, generators)):
        if spec.greedy or generator is None:
            continue
        probs = _truncated_probs(logprobs_all[row], spec)
        tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
    return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1)


def _truncated_probs_rows(logprobs: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """`_truncated_probs` of every row of `logprobs` [n, V] at once (each row its own spec);
    [n, V] float32, rows summing to 1."""
    probs = logprobs.exp()
    rows, vocab = probs.shape
    device = probs.device
    if any((0 < s.top_k < vocab) or s.top_p < 1.0 for s in specs):
        top_k = torch.tensor(
            [s.top_k if 0 < s.top_k < vocab else vocab for s in specs], device=device
        )
        top_p = torch.tensor([s.top_p for s in specs], dtype=probs.dtype, device=device)
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        rank = torch.arange(vocab, device=device)[None, :]
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # keep the first top_k, and the smallest head whose mass reaches top_p (the first always)
        keep = (rank < top_k[:, None]) & ((before <= top_p[:, None]) | (top_p[:, None] >= 1.0))
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)
    if any(s.min_p > 0.0 for s in specs):
        min_p = torch.tensor([s.min_p for s in specs], dtype=probs.dtype, device=device)
        floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs >= floor, probs, torch.zeros_like(probs))
    return probs / probs.sum(dim=-1, keepdim=True)


def _truncated_probs(logprobs: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """The distribution a token is drawn from: softmax(logits / T) after top-k, top-p, min-p."""
    probs = logprobs.exp()
    vocab = probs.shape[0]
    if (0 < spec.top_k < vocab) or spec.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        keep = torch.ones_like(sorted_probs, dtype=torch.bool)
        if 0 < spec.top_k < vocab:
            keep[spec.top_k :] = False
        if (
            spec.top_p < 1.0
        ):  # keep the smallest head whose mass reaches top_p (the first token always)
            before = torch.cumsum(sorted_probs, 0) - sorted_probs
            keep &= before <= spec.top_p
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs * keep)
    if spec.min_p > 0.0:
        probs = torch.where(probs >= spec.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs / probs.sum()
