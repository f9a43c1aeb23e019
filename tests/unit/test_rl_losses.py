import math

import pytest
import torch

from shellrl.rl.losses import LossStats, PPOConfig, decoupled_ppo_loss, k3_kl, loss_weights


def loss_of(logp, prox, behavior, adv, mask=None, **cfg):
    t = lambda x: torch.tensor([x], dtype=torch.float32)
    mask = t(mask if mask is not None else [1.0] * len(logp))
    weights = loss_weights(mask)
    return decoupled_ppo_loss(
        t(logp), t(prox), t(behavior), t(adv), mask, weights, PPOConfig(**cfg)
    )


def test_fresh_on_policy_tokens_give_reinforce_with_ratio_one():
    loss, stats = loss_of([-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0], [1.0, -1.0])
    assert loss.item() == pytest.approx(0.0)  # (-1*1 + 1*1) / 2
    s = stats.summary()
    assert s["is_weight_mean"] == 1.0 and s["clip_fraction_low"] == s["clip_fraction_high"] == 0.0


def test_clip_binds_above_one_plus_eps_high_for_positive_advantage():
    loss, stats = loss_of([math.log(2.0)], [0.0], [0.0], [1.0])
    assert loss.item() == pytest.approx(-1.28, abs=1e-6)
    assert stats.clipped_high == 1


def test_dual_clip_caps_negative_advantage_at_c_times_abs_a():
    loss, stats = loss_of([math.log(10.0)], [0.0], [0.0], [-2.0])
    assert loss.item() == pytest.approx(6.0, abs=1e-5)  # min(2 * 10, 3 * 2)
    assert stats.dual_clipped == 1


def test_plus_fifty_log_ratio_gives_a_finite_bounded_loss_and_gradient():
    for adv in (1.0, -1.0):
        logp = torch.tensor([[49.0, -1.0]], requires_grad=True)  # +50 against the proximal -1
        mask = torch.ones(1, 2)
        loss, stats = decoupled_ppo_loss(
            logp,
            torch.tensor([[-1.0, -1.0]]),
            torch.tensor([[-1.0, -1.0]]),
            torch.tensor([[adv, adv]]),
            mask,
            loss_weights(mask),
            PPOConfig(),
        )
        loss.backward()
        assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all()
        assert abs(loss.item()) <= 3.0 * abs(adv)
        assert stats.log_ratio_clamped == 1


def test_engine_logprob_fifty_nats_below_truncates_the_behavior_weight():
    # pitfall C21: engine -51, trainer -1, advantage -1: weight min(e^50, 2) = 2, loss 2 per token
    loss, stats = loss_of([-1.0], [-1.0], [-51.0], [-1.0])
    assert loss.item() == pytest.approx(2.0)
    assert stats.is_truncated == 1 and stats.log_ratio_clamped == 1
    assert stats.is_weight_max == pytest.approx(math.exp(20.0), rel=1e-5)  # clamp at M = 20


def test_padding_and_nan_off_the_mask_never_reach_the_loss():
    loss, stats = loss_of(
        [-1.0, float("nan")], [-1.0, 0.0], [-1.0, 0.0], [1.0, 1.0], mask=[1.0, 0.0]
    )
    assert loss.item() == pytest.approx(-1.0) and stats.tokens == 1


def test_seq_mean_token_mean_weighs_each_sequence_equally():
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    w = loss_weights(mask, "seq_mean_token_mean")
    assert w[0].sum().item() == pytest.approx(0.5) and w[1].sum().item() == pytest.approx(0.5)
    assert loss_weights(mask, "token_mean").sum().item() == pytest.approx(1.0)
    assert loss_weights(torch.zeros(2, 3)).sum().item() == 0.0


def test_kl_term_is_k3_and_needs_reference():
    assert k3_kl(torch.tensor([0.0]), torch.tensor([0.0])).item() == 0.0
    assert k3_kl(torch.tensor([-1.0]), torch.tensor([0.0])).item() == pytest.approx(math.e - 2)
    mask = torch.ones(1, 1)
    with pytest.raises(ValueError):
        decoupled_ppo_loss(mask, mask, mask, mask, mask, mask, PPOConfig(kl_coef=0.1))


def test_stats_merge_sums_counts_and_takes_max():
    a = LossStats(tokens=2, clipped_low=1, is_weight_max=1.5)
    b = LossStats(tokens=3, clipped_low=0, is_weight_max=4.0)
    merged = a + b
    assert merged.tokens == 5 and merged.clipped_low == 1 and merged.is_weight_max == 4.0


def test_invalid_config_is_rejected():
    with pytest.raises(ValueError):
        PPOConfig(dual_clip_c=1.0)
    with pytest.raises(ValueError):
        PPOConfig(aggregation="sum")


def _expected_kl_gradient(kl_coef: float = 1.0) -> tuple[torch.Tensor, float]:
    """Gradient w.r.t. the logits of E_{a ~ pi}[KL term of token a], exactly (each of the two tokens
    weighted by pi(a)), on the public case of NeMo-RL #2506 / TRL #4967: logits [0, 0] (pi = [0.5,
    0.5]), reference probabilities [0.9, 0.1], on-policy (behavior = proximal = current)."""
    logits = torch.zeros(2, requires_grad=True)
    logp_all = torch.log_softmax(logits, -1)
    ref_all = torch.log(torch.tensor([0.9, 0.1]))
    total, reported = torch.zeros(()), 0.0
    for a in range(2):
        logp = logp_all[a].reshape(1, 1)
        pi_a = logp.detach().exp()
        loss, stats = decoupled_ppo_loss(
            logp,
            logp.detach(),
            logp.detach(),
            torch.zeros(1, 1),
            torch.ones(1, 1),
            pi_a,
            PPOConfig(kl_coef=kl_coef),
            ref_logprobs=ref_all[a].reshape(1, 1),
        )
        total, reported = total + loss, reported + stats.kl
    total.backward()
    return logits.grad, reported


def test_kl_term_gradient_is_that_of_kl_pi_to_ref():
    grad, reported = _expected_kl_gradient()
    # d KL(pi || ref) / d logits = pi * (log(pi / ref) - KL) = [-0.549306, +0.549306]; the k3 value
    # without the ratio would give [-0.4, +0.4] (the forward KL's direction), k1 alone [0, 0]
    assert grad.tolist() == pytest.approx([-0.549306, 0.549306], abs=1e-5)
    kl_pi_ref = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert reported == pytest.approx(kl_pi_ref, abs=1e-6)  # k3 is unbiased for the value
