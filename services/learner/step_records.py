"""What the ranks of one learner step share (trainer.py, data_parallel.py): the `StepPlan` every
rank agrees on before it (passes per epoch, the whole step's loss normalisation), the `idle_batch`
a rank with fewer rows trains on so that it joins every pass of the others, and the `StepResult`
each rank returns (data_parallel.merge_results combines them; step_metrics.py exports them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shellrl.rl.batch import TrainBatch, TrainSample, build_batch
from shellrl.rl.losses import LossStats


@dataclass(frozen=True)
class StepPlan:
    """What every rank of one step agrees on. micro_batches: forward/backward passes per epoch
    on every rank; loss_tokens, loss_rows: the whole step's scored tokens, and rows with at
    least one (the loss normalisation, shellrl.rl.losses.loss_weights)."""

    micro_batches: int
    loss_tokens: int
    loss_rows: int

    @staticmethod
    def of(shares: list[list[TrainSample]], micro_batch_size: int) -> StepPlan:
        """The plan of a step whose rank r trains `shares[r]`."""
        counts = [int(np.count_nonzero(s.loss_mask)) for share in shares for s in share]
        return StepPlan(
            micro_batches=max(-(-len(share) // micro_batch_size) for share in shares),
            loss_tokens=sum(counts),
            loss_rows=sum(c > 0 for c in counts),
        )


@dataclass(frozen=True)
class StepResult:
    """What one step did (on one rank: its share; data_parallel.merge_results combines them).
    `stats`: LossStats.summary() of the last epoch plus grad norms, `totals` its raw sums; parity_*
    in nats over `parity_tokens` version-fresh tokens; durations in seconds. row_kl: per trained
    row (trajectory_id, sum of the k3 KL to the reference over its scored tokens, their count),
    under the weights the step started from (its first epoch); empty without a reference."""

    step: int
    lr: float
    stats: dict[str, float]
    grad_norm: float
    parity_mean: float
    parity_max: float
    parity_tokens: int
    sequences: int
    tokens: int
    duration_s: float
    skipped_updates: int
    totals: LossStats = field(default_factory=LossStats)
    row_kl: tuple[tuple[str, float, int], ...] = ()


def idle_batch() -> TrainBatch:
    """One row of two tokens whose one scored position carries no loss (Trainer._idle_pass)."""
    sample = TrainSample(
        trajectory_id="idle",
        prompt_ids=np.zeros(1, np.int64),
        response_ids=np.zeros(1, np.int64),
        behavior_logprobs=np.zeros(1, np.float32),
        loss_mask=np.zeros(1, np.uint8),
        policy_versions=np.full(1, -1),
        temperatures=np.ones(1, np.float32),
        advantage=0.0,
    )
    return build_batch([sample], pad_token_id=0)
