"""Behaviour log-probs as SGLang reports them: log_softmax(logits / T) before top-k/top-p truncation."""

from __future__ import annotations

import torch

from services.engine.sampling import SamplingSpec, sample_next


def test_logprob_is_the_tempered_full_vocabulary_distribution_even_with_top_p_and_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    for spec in (SamplingSpec(0.7), SamplingSpec(0.7, top_p=0.5), SamplingSpec(0.7, top_k=2)):
        token, logprob = sample_next(logits, [spec], [torch.Generator().manual_seed(0)])
        expected = torch.log_softmax(logits / 0.7, dim=-1)[0, token]
        assert torch.allclose(logprob, expected)


def test_truncation_restricts_the_sampled_support():
    logits = torch.tensor([[2.0, 1.9, -5.0, -5.0, -5.0]] * 200)
    specs = [SamplingSpec(1.0, top_k=2)] * 200
    tokens, _ = sample_next(logits, specs, [torch.Generator().manual_seed(i) for i in range(200)])
    assert set(tokens.tolist()) == {0, 1}
    tokens, _ = sample_next(logits, [SamplingSpec(1.0, top_p=0.4)] * 200, [None] * 200)
    assert set(tokens.tolist()) == {0}


def test_greedy_takes_the_argmax_and_reports_the_raw_distribution():
    logits = torch.tensor([[0.1, 3.0, 2.9]])
    token, logprob = sample_next(logits, [SamplingSpec(0.0)], [None])
    assert token.item() == 1 and torch.allclose(logprob, torch.log_softmax(logits, -1)[0, 1])


def test_a_seeded_row_draws_the_same_token_whatever_its_batch():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    alone, _ = sample_next(
        logits[1:2], [SamplingSpec(1.0, seed=5)], [torch.Generator().manual_seed(5)]
    )
    batch, _ = sample_next(
        logits,
        [SamplingSpec(1.0)] * 3,
        [torch.Generator().manual_seed(9), torch.Generator().manual_seed(5), None],
    )
    assert batch[1] == alone[0]
