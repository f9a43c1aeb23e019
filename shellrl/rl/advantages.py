"""GRPO group advantages (DESIGN.md section 5).

For the rewards R of one group: A_i = (R_i - mean(R)) / (std(R) + eps), population std (ddof=0),
eps = 1e-4. Source: DeepSeekMath (Shao et al. 2024, arXiv 2402.03300) section 4.1.2 "outcome
supervision"; the population std and the eps follow TRL's GRPOTrainer and the reference values of
known_pitfalls.md C10. A group whose rewards are all equal carries no signal: its advantages are
exactly 0 and it is flagged `zero_variance` (the learner by default does not train on it).

Groups are normalised per group (per prompt), never across the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EPS = 1e-4


@dataclass(frozen=True)
class GroupAdvantages:
    """advantages: [G] float32, one per trajectory in group order; zero_variance: all rewards equal."""

    advantages: np.ndarray
    zero_variance: bool
    reward_mean: float
    reward_std: float


def group_advantages(rewards, eps: float = EPS) -> GroupAdvantages:
    """GRPO advantages of one group.

    rewards: [G] real numbers, G >= 1. Returns advantages [G] float32 that sum to 0 (within float
    rounding); all exactly 0 when the rewards are all equal (zero_variance=True).
    Raises ValueError on an empty group or a non-finite reward (NaN/inf rewards must be removed
    from the group before, as the group assembler does).

    Examples (eps=1e-4): [1,0,1,0] -> [0.9998, -0.9998, 0.9998, -0.9998];
    [1,0,0,0] -> [1.7317, -0.5772, -0.5772, -0.5772]; [1,1,1,1] -> [0,0,0,0].
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D sequence; got shape {r.shape}")
    if not np.isfinite(r).all():
        raise ValueError(f"rewards must be finite; got {r.tolist()}")
    mean, std = float(r.mean()), float(r.std())  # population std (ddof=0)
    if r.max() == r.min():
        return GroupAdvantages(np.zeros(r.size, dtype=np.float32), True, mean, 0.0)
    adv = ((r - mean) / (std + eps)).astype(np.float32)
    return GroupAdvantages(adv, False, mean, std)
