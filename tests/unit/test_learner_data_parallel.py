"""Data parallelism of the learner without a process group: how a step is split across ranks, the
loss normalisation that makes the split invisible, and world size 1 on the same path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.learner.checkpoint import CheckpointStore
from services.learner.data_parallel import DataParallel, merge_results, split_by_tokens
from services.learner.step_records import StepPlan
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig
from shellrl.models import load_model
from shellrl.rl.batch import build_batch
from shellrl.rl.losses import LossStats, loss_weights
from tests.unit.test_rl_logprobs import make_samples


def tokens(share) -> int:
    return sum(len(s.prompt_ids) + len(s.response_ids) for s in share)


def test_split_by_tokens_balances_the_ranks_and_keeps_each_shares_order():
    samples = make_samples(9, seed=3)
    shares = split_by_tokens(samples, 2)
    assert sorted(s.trajectory_id for share in shares for s in share) == sorted(
        s.trajectory_id for s in samples
    )
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    assert abs(tokens(shares[0]) - tokens(shares[1])) <= longest
    order = [s.trajectory_id for s in samples]
    for share in shares:
        ids = [s.trajectory_id for s in share]
        assert ids == sorted(ids, key=order.index)


def test_fewer_samples_than_ranks_leave_some_ranks_an_empty_share_and_a_plan_of_idle_passes():
    shares = split_by_tokens(make_samples(2), 4)
    assert sorted(len(s) for s in shares) == [0, 0, 1, 1]
    plan = StepPlan.of(shares, micro_batch_size=4)
    assert plan.micro_batches == 1  # the empty ranks run one idle pass with the others


def test_the_plan_counts_the_whole_steps_scored_tokens_and_the_longest_shares_passes():
    samples = make_samples(7, seed=1)
    shares = split_by_tokens(samples, 2)
    plan = StepPlan.of(shares, micro_batch_size=2)
    assert plan.loss_tokens == sum(int(np.count_nonzero(s.loss_mask)) for s in samples)
    assert plan.loss_rows == 7
    assert plan.micro_batches == max(-(-len(s) // 2) for s in shares)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_the_shares_loss_weights_with_the_steps_totals_are_the_whole_batchs(aggregation):
    samples = make_samples(6, seed=2)
    whole = build_batch(samples, pad_token_id=2)
    expected = loss_weights(whole.loss_mask, aggregation)
    plan = StepPlan.of([samples[:2], samples[2:]], micro_batch_size=8)
    for lo, hi in ((0, 2), (2, 6)):
        part = build_batch(samples[lo:hi], pad_token_id=2)
        got = loss_weights(
            part.loss_mask, aggregation, loss_tokens=plan.loss_tokens, loss_rows=plan.loss_rows
        )
        width = got.shape[1]
        assert torch.allclose(got, expected[lo:hi, :width], rtol=0, atol=0)
        assert expected[lo:hi, width:].sum() == 0


def test_world_size_1_takes_the_data_parallel_path_with_exactly_the_trainers_step(tmp_path):
    torch.manual_seed(0)
    config = TrainerConfig(lr=1e-3, micro_batch_size=2)
    direct_model, path_model = load_model("tiny"), load_model("tiny")
    direct, trainer = Trainer(direct_model, config), Trainer(path_model, config)
    dp = DataParallel(trainer, CheckpointStore(tmp_path), pad_token_id=2)
    assert dp.weights is path_model  # nothing to gather: the push reads the model itself
    samples = make_samples(5, seed=20)
    want = direct.step(build_batch(samples, pad_token_id=2), 0)
    got = dp.step(samples, 0)
    assert got.stats == want.stats and got.tokens == want.tokens
    for (name, a), (_, b) in zip(direct_model.named_parameters(), path_model.named_parameters()):
        assert torch.equal(a, b), name


def test_merged_results_sum_the_ranks_losses_and_pool_their_parity():
    a = _result(LossStats(policy_loss=0.25, tokens=3), parity=(0.1, 0.3, 2), sequences=2)
    b = _result(LossStats(policy_loss=-0.5, tokens=5), parity=(0.4, 0.5, 6), sequences=3)
    merged = merge_results([a, b])
    assert merged.stats["policy_loss"] == pytest.approx(-0.25) and merged.stats["tokens"] == 8
    assert merged.parity_tokens == 8 and merged.parity_max == 0.5
    assert merged.parity_mean == pytest.approx((0.1 * 2 + 0.4 * 6) / 8)
    assert merged.sequences == 5 and merged.grad_norm == a.grad_norm


def _result(totals: LossStats, parity: tuple, sequences: int):
    from services.learner.step_records import StepResult

    return StepResult(
        step=1,
        lr=1e-3,
        stats={**totals.summary(), "grad_norm": 2.0},
        grad_norm=2.0,
        parity_mean=parity[0],
        parity_max=parity[1],
        parity_tokens=parity[2],
        sequences=sequences,
        tokens=int(totals.tokens),
        duration_s=0.1,
        skipped_updates=0,
        totals=totals,
    )
