"""A released group (group_assembler.RolloutGroup) -> TrainSamples: GRPO advantages over the
members' training_reward broadcast to their ACTION tokens, the per-token sampling temperatures
(the engine's, or a fixed override), and DAPO's overlong filtering (a truncated member keeps its
place in the reward statistics, with loss mask 0). The learner's worker calls `group_samples` on
every trainable group of a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.learner.group_assembler import RolloutGroup
from shellrl.contract import FinishReason, SegmentKind, Trajectory
from shellrl.rl.advantages import group_advantages
from shellrl.rl.batch import TrainSample


def token_temperatures(traj: Trajectory, fixed_temperature: float | None = None) -> np.ndarray:
    """[R] float32: the sampling temperature of each response token (ACTION segments: their
    `sampling.temperature`, or `fixed_temperature` when given; OBSERVATION tokens: 1.0)."""
    parts = []
    for seg in traj.segments:
        n = len(seg.token_ids) // 4
        t = 1.0
        if seg.kind == SegmentKind.SEGMENT_KIND_ACTION:
            t = fixed_temperature if fixed_temperature is not None else seg.sampling.temperature
        parts.append(np.full(n, t, dtype=np.float32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


@dataclass(frozen=True)
class GroupSamples:
    """TrainSamples of one group, its GRPO statistics, and whether it carries a gradient."""

    samples: tuple[TrainSample, ...]
    rewards: tuple[float, ...]
    zero_variance: bool


def is_truncated(traj: Trajectory) -> bool:
    """Cut off by a length limit: the context budget (`truncated`) or a last ACTION segment that
    ended with finish_reason LENGTH. An EOS on the last allowed position is a STOP, not a cut
    (known_pitfalls C06: the test is the finish reason, not the absence of EOS)."""
    actions = [seg for seg in traj.segments if seg.kind == SegmentKind.SEGMENT_KIND_ACTION]
    return traj.truncated or bool(
        actions and actions[-1].finish_reason == FinishReason.FINISH_REASON_LENGTH
    )


def group_samples(
    group: RolloutGroup, fixed_temperature: float | None = None, overlong_filtering: bool = False
) -> GroupSamples:
    """GRPO advantages over the members' training_reward, broadcast to their ACTION tokens.

    overlong_filtering: truncated members (`is_truncated`) keep their place in the group's
    reward statistics but get loss mask 0 (DAPO, arXiv 2503.14476 section 3.4).
    Raises ValueError for a group with fewer than 2 members (see RolloutGroup.trainable)."""
    if not group.trainable:
        raise ValueError(f"group {group.group_id} has {len(group.members)} members; need >= 2")
    rewards = [m.trajectory.training_reward for m in group.members]
    adv = group_advantages(rewards)
    samples = tuple(
        TrainSample(
            trajectory_id=m.trajectory_id,
            prompt_ids=m.arrays.prompt_ids,
            response_ids=m.arrays.response_ids,
            behavior_logprobs=m.arrays.behavior_logprobs,
            loss_mask=np.zeros_like(m.arrays.loss_mask)
            if overlong_filtering and is_truncated(m.trajectory)
            else m.arrays.loss_mask,
            policy_versions=m.arrays.policy_versions,
            temperatures=token_temperatures(m.trajectory, fixed_temperature),
            advantage=float(a),
        )
        for m, a in zip(group.members, adv.advantages)
    )
    return GroupSamples(samples, tuple(rewards), adv.zero_variance)
