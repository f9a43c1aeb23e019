"""Decoupled PPO policy loss (as in AReaL), with dual clip, truncated behavior importance weight,
log-ratio clamping, optional KL to a reference policy, and batch-level aggregation weights.

Per scored token, with advantage A, current log-prob logp, proximal log-prob logp_prox (the
learner's at the start of the step, no gradient) and behavior log-prob logp_behavior (engine):

    r = exp(clamp(logp - logp_prox, -M, M))                        (policy ratio)
    w = min(exp(clamp(logp_prox - logp_behavior, -M, M)), C)        (behavior IS weight, truncated)
    l = max(-A * r, -A * clip(r, 1 - eps_low, 1 + eps_high))        (PPO clip)
    l = min(l, c * |A|)              if A < 0                        (dual clip)
    loss_token = w * l + kl_coef * w * r * k3(logp, logp_ref)       (k3 = exp(d) - d - 1, d = ref - logp)

Sources: decoupled PPO, Fu et al. 2025 "AReaL" (arXiv 2505.24298) eq. 5 and
inclusionAI/AReaL areal/utils/functional.py (AReaL masks tokens with w > C; we truncate w to C
as the issue and DESIGN.md section 5 specify, i.e. truncated importance sampling, Ionides 2008);
clip-higher eps_high = 0.28 from DAPO (arXiv 2503.14476); dual clip from Ye et al. 2020
(arXiv 1912.09729); k3 estimator from J. Schulman, "Approximating KL divergence" (2020).
The KL term carries the importance ratio w * r (r with its gradient): its value is the k3 estimate
of KL(pi || ref) (what `LossStats.kl` reports), and its gradient, (logp - logp_ref) * grad logp per
sampled token (times w * r off-policy), is in expectation the gradient of KL(pi || ref). k3 alone in
the loss has the gradient of the forward KL(ref || pi) instead, and k1 alone has none (NeMo-RL
#2506, TRL #4967; tests/unit/test_rl_losses.py checks the exact value on their two-token case).
The log-ratio clamp M (default 20) keeps exp finite: a +50 log-ratio gives a bounded loss
(|loss_token| <= C * max(c, 1 + eps_high) * |A|) and zero gradient (known_pitfalls.md C21).

With one inner update per batch (ppo_epochs = 1), logp == logp_prox in value, r = 1, the clip
never binds and the loss is REINFORCE with a group baseline, weighted by w.

Aggregation: `loss_weights` turns the whole batch's loss mask into per-token weights that sum
to 1 (token-mean) or give each sequence weight 1/B (seq-mean-token-mean); a micro-batch's loss is
sum(loss_token * weight) over its tokens, so the sum over micro-batches is the batch loss
whatever the split.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean"]


@dataclass(frozen=True)
class PPOConfig:
    """clip_eps_low/high: ratio clip [1-low, 1+high]; dual_clip_c: > 1, None = off;
    behavior_weight_cap: C of the truncated IS weight, None = no behavior weight (w = 1);
    max_log_ratio: M, clamp of both log-ratios (nats); kl_coef: weight of the k3 KL to the
    reference policy (0 = off); aggregation: token_mean or seq_mean_token_mean."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.28
    dual_clip_c: float | None = 3.0
    behavior_weight_cap: float | None = 2.0
    max_log_ratio: float = 20.0
    kl_coef: float = 0.0
    aggregation: Aggregation = "token_mean"

    def __post_init__(self) -> None:
        if not (0 <= self.clip_eps_low < 1 and self.clip_eps_high >= 0):
            raise ValueError(
                f"clip eps must satisfy 0 <= low < 1, high >= 0; got {self.clip_eps_low}, {self.clip_eps_high}"
            )
        if self.dual_clip_c is not None and self.dual_clip_c <= 1:
            raise ValueError(f"dual_clip_c must be > 1; got {self.dual_clip_c}")
        if self.behavior_weight_cap is not None and self.behavior_weight_cap <= 0:
            raise ValueError(f"behavior_weight_cap must be > 0; got {self.behavior_weight_cap}")
        if self.max_log_ratio <= 0:
            raise ValueError(f"max_log_ratio must be > 0; got {self.max_log_ratio}")
        if self.aggregation not in ("token_mean", "seq_mean_token_mean"):
            raise ValueError(
                f"aggregation must be token_mean or seq_mean_token_mean; got {self.aggregation!r}"
            )


def loss_weights(
    loss_mask: torch.Tensor,
    aggregation: Aggregation = "token_mean",
    *,
    loss_tokens: int | None = None,
    loss_rows: int | None = None,
) -> torch.Tensor:
    """Per-token aggregation weights of the WHOLE batch (or of one rank's share of it).

    loss_mask: [B, T] 0/1. Returns [B, T] float32: token_mean -> mask / (total scored tokens);
    seq_mean_token_mean -> mask / (tokens of the row * rows with at least one token). All zero
    when nothing is scored. loss_tokens, loss_rows: those totals over the whole step when
    `loss_mask` is one rank's share (data parallel: the weights of all ranks then sum to 1, so
    the summed gradients are the whole step's); None: counted from `loss_mask`.
    """
    mask = loss_mask.float()
    if aggregation == "token_mean":
        total = mask.sum() if loss_tokens is None else mask.new_tensor(float(loss_tokens))
        return mask / total.clamp(min=1.0)
    if aggregation == "seq_mean_token_mean":
        per_row = mask.sum(-1, keepdim=True)
        rows = (per_row > 0).sum() if loss_rows is None else mask.new_tensor(loss_rows).long()
        return mask / (per_row.clamp(min=1.0) * rows.clamp(min=1).float())
    raise ValueError(f"unknown aggregation {aggregation!r}")


@dataclass
class LossStats:
    """Sums over scored tokens (merge micro-batches with `+`; `*_max` fields take the max).

    policy_loss, kl: weighted sums (their batch value after merging). tokens: scored tokens.
    clipped_low/high: tokens whose gradient the PPO clip zeroed (A < 0, r < 1-eps_low / A > 0,
    r > 1+eps_high); dual_clipped: tokens capped at c*|A|; is_weight_sum: sum of applied w;
    is_weight_max: largest untruncated w (after the log clamp); is_truncated: tokens with w > C;
    log_ratio_clamped: tokens where either log-ratio exceeded M in magnitude; ratio_max: largest r.
    """

    policy_loss: float = 0.0
    kl: float = 0.0
    tokens: float = 0.0
    clipped_low: float = 0.0
    clipped_high: float = 0.0
    dual_clipped: float = 0.0
    is_weight_sum: float = 0.0
    is_weight_max: float = 0.0
    is_truncated: float = 0.0
    log_ratio_clamped: float = 0.0
    ratio_max: float = 0.0

    def __add__(self, other: LossStats) -> LossStats:
        out = LossStats()
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(out, f.name, max(a, b) if f.name.endswith("_max") else a + b)
        return out

    def summary(self) -> dict[str, float]:
        """Fractions and means for metrics and /v1/status."""
        n = max(self.tokens, 1.0)
        return {
            "policy_loss": self.policy_loss,
            "kl": self.kl,
            "tokens": self.tokens,
            "clip_fraction_low": self.clipped_low / n,
            "clip_fraction_high": self.clipped_high / n,
            "dual_clip_fraction": self.dual_clipped / n,
            "is_weight_mean": self.is_weight_sum / n,
            "is_weight_max": self.is_weight_max,
            "is_truncated_fraction": self.is_truncated / n,
            "log_ratio_clamped": self.log_ratio_clamped,
            "ratio_max": self.ratio_max,
        }


def k3_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, max_log_ratio: float = 20.0
) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(d) - d - 1 with d = clamp(ref - logp, +-M). >= 0."""
    d = (ref_logprobs - logprobs).clamp(-max_log_ratio, max_log_ratio)
    return torch.exp(d) - d - 1.0


def row_kl(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    max_log_ratio: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the sum of the k3 KL(pi || ref) estimate (`k3_kl`, the term `decoupled_ppo_loss`
    adds) over its scored tokens, and their count. Inputs [b, T] float32; returns ([b], [b])
    float32, without gradient. The mean KL per token of a set of rows is sum(kl) / sum(tokens)."""
    with torch.no_grad():
        mask = (loss_mask > 0).to(logprobs.dtype)
        kl = k3_kl(logprobs.detach(), ref_logprobs.detach(), max_log_ratio)
        return (torch.where(mask > 0, kl, torch.zeros_like(kl))).sum(-1), mask.sum(-1)


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    weights: torch.Tensor,
    config: PPOConfig,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """The decoupled PPO loss of a (micro-)batch, see the module docstring.

    All inputs [b, T] float32 (loss_mask 0/1; weights from `loss_weights` of the whole batch,
    sliced to these rows/columns); only `logprobs` carries gradient. ref_logprobs: [b, T] or
    None (required when config.kl_coef > 0). Returns (scalar loss = sum(loss_token * weights),
    LossStats of these tokens). Raises ValueError on mismatched shapes or a missing reference.
    """
    shape = logprobs.shape
    for name, t in (
        ("proximal_logprobs", proximal_logprobs),
        ("behavior_logprobs", behavior_logprobs),
        ("advantages", advantages),
        ("loss_mask", loss_mask),
        ("weights", weights),
    ):
        if t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, logprobs {tuple(shape)}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    m = config.max_log_ratio
    mask = loss_mask > 0
    proximal_logprobs, behavior_logprobs = proximal_logprobs.detach(), behavior_logprobs.detach()

    log_ratio = logprobs - proximal_logprobs
    ratio = torch.exp(log_ratio.clamp(-m, m))
    clipped = ratio.clamp(1.0 - config.clip_eps_low, 1.0 + config.clip_eps_high)
    loss = torch.maximum(-advantages * ratio, -advantages * clipped)
    dual = torch.zeros_like(mask)
    if config.dual_clip_c is not None:
        cap = config.dual_clip_c * advantages.abs()
        dual = (advantages < 0) & (loss.detach() > cap)
        loss = torch.where(advantages < 0, torch.minimum(loss, cap), loss)

    behavior_log_ratio = proximal_logprobs - behavior_logprobs
    raw_weight = torch.exp(behavior_log_ratio.clamp(-m, m))
    if config.behavior_weight_cap is not None:
        weight = raw_weight.clamp(max=config.behavior_weight_cap)
        truncated = raw_weight > config.behavior_weight_cap
    else:
        weight, truncated = torch.ones_like(raw_weight), torch.zeros_like(mask)
    loss = weight * loss

    kl = torch.zeros_like(loss)
    if config.kl_coef > 0:
        kl = k3_kl(logprobs, ref_logprobs.detach(), m)
        loss = (
            loss + config.kl_coef * weight * ratio * kl
        )  # the ratio makes the gradient KL(pi || ref)'s

    weights = torch.where(mask, weights, torch.zeros_like(weights))
    loss = torch.where(mask, loss, torch.zeros_like(loss))  # padding never contributes (nor NaN)
    total = (loss * weights).sum()

    with torch.no_grad():
        clamped = (log_ratio.abs() > m) | (behavior_log_ratio.abs() > m)
        stats = LossStats(
            policy_loss=float(total),
            kl=float((kl * weights).sum()),
            tokens=float(mask.sum()),
            clipped_low=float(
                (mask & (advantages < 0) & (ratio < 1.0 - config.clip_eps_low)).sum()
            ),
            clipped_high=float(
                (mask & (advantages > 0) & (ratio > 1.0 + config.clip_eps_high)).sum()
            ),
            dual_clipped=float((mask & dual).sum()),
            is_weight_sum=float(weight[mask].sum()),
            is_weight_max=float(raw_weight[mask].max()) if mask.any() else 0.0,
            is_truncated=float((mask & truncated).sum()),
            log_ratio_clamped=float((mask & clamped).sum()),
            ratio_max=float(ratio[mask].max()) if mask.any() else 0.0,
        )
    return total, stats
