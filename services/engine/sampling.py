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
    """
    rows = logits.shape[0]
    temperatures = torch.tensor(
        [1.0 if s.greedy else s.temperature for s in specs],
        dtype=logits.dtype,
        device=logits.device,
    )
    logprobs_all = torch.log_softmax(logits / temperatures[:, None], dim=-1)
    tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
    for row, (spec, generator) in enumerate(zip(specs, generators)):
        if spec.greedy:
            tokens[row] = torch.argmax(logits[row])
            continue
        probs = _truncated_probs(logprobs_all[row], spec)
        tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
    return tokens, logprobs_all.gather(1, tokens[:, None]).squeeze(1)


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
