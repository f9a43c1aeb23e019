"""KL to the initial policy per template in the learner's step record (issue 33 item 1): the
trainer's per-row k3 KL sums (StepResult.row_kl) against a direct computation with plain full
forwards of the tiny model's policy and reference, and their mean per template
(services/learner/template_kl.py) against the same direct values."""

from __future__ import annotations

import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from services.learner.data_parallel import merge_results
from services.learner.kl_probe import KlSequence, sequences_kl
from services.learner.step_records import StepResult
from services.learner.template_kl import kl_by_template, trajectory_template
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig
from shellrl.contract import Task, Trajectory
from shellrl.models import load_model
from shellrl.rl.batch import build_batch
from shellrl.rl.logprobs import token_logprobs
from shellrl.rl.losses import PPOConfig
from tests.unit.test_rl_logprobs import group_samples_sharing

# the main job's learner (cli/main_job.py): a group per micro-batch, shared prefix, KL 0.1
JOB = TrainerConfig(
    lr=1e-3,
    micro_batch_size=4,
    gradient_checkpointing=False,
    share_prefix_min_tokens=16,
    loss=PPOConfig(kl_coef=0.1),
)
# float32 on CPU; the step shares the prompt's forward and runs rows unpadded, the direct
# computation runs every padded row in full: the same log-probs to float rounding
REL_TOL, ABS_TOL = 1e-4, 1e-6


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def nudged_trainer() -> Trainer:
    """A trainer of the tiny model whose policy was moved off its reference (so KL > 0)."""
    trainer = Trainer(copy.deepcopy(load_model("tiny")), JOB)
    with torch.no_grad():
        for i, p in enumerate(trainer.params):
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
    return trainer


def direct_row_kl(trainer: Trainer, batch) -> list[tuple[float, int]]:
    """Per row: sum over scored tokens of exp(d) - d - 1, d = logp_ref - logp (Schulman's k3),
    from plain full forwards (no prefix sharing, padded rows), and the scored token count."""
    with torch.no_grad():
        logp = token_logprobs(trainer.model, batch)
        ref = token_logprobs(trainer.reference, batch)
    d = ref.double() - logp.double()
    mask = batch.loss_mask > 0
    k3 = torch.where(mask, torch.exp(d) - d - 1.0, torch.zeros_like(d))
    return [(float(k3[i].sum()), int(mask[i].sum())) for i in range(batch.size)]


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL_TOL * abs(b) + ABS_TOL


def member(trajectory_id: str, task_id: str, template: str = "") -> SimpleNamespace:
    traj = Trajectory(trajectory_id=trajectory_id, task_id=task_id)
    if template:
        traj.task.CopyFrom(Task(task_id=task_id, template=template))
    return SimpleNamespace(trajectory_id=trajectory_id, trajectory=traj)


def test_step_reports_each_rows_kl_to_the_reference_as_computed_directly():
    batch = build_batch(group_samples_sharing(40, 8, seed=9), pad_token_id=2)
    trainer = nudged_trainer()
    expected = direct_row_kl(trainer, batch)  # under the weights the step starts from
    result = trainer.step(batch, 0)
    assert [r[0] for r in result.row_kl] == list(batch.trajectory_ids)
    for (_, kl, tokens), (want_kl, want_tokens) in zip(result.row_kl, expected):
        assert tokens == want_tokens and want_kl > 0
        assert close(kl, want_kl), (kl, want_kl)
    # the step's KL (token mean) is the same sum over every row
    total = sum(kl for kl, _ in expected) / sum(n for _, n in expected)
    assert close(result.stats["kl"], total)


def test_kl_by_template_is_the_token_mean_of_its_rows():
    batch = build_batch(group_samples_sharing(40, 6, seed=3), pad_token_id=2)
    trainer = nudged_trainer()
    expected = direct_row_kl(trainer, batch)
    result = trainer.step(batch, 0)
    templates = ["count_lines", "file_size_bytes", "count_lines", "", "count_lines", ""]
    members = [
        member(tid, f"gen-x-{i:012x}" if t else "seed-task", t)
        for i, (tid, t) in enumerate(zip(batch.trajectory_ids, templates))
    ]
    by_template = kl_by_template([SimpleNamespace(members=members)], result.row_kl)
    assert set(by_template) == {"count_lines", "file_size_bytes", "seed-task"}
    for name in by_template:
        rows = [i for i, m in enumerate(members) if trajectory_template(m.trajectory) == name]
        tokens = sum(expected[i][1] for i in rows)
        want = sum(expected[i][0] for i in rows) / tokens
        got = by_template[name]
        assert got["tokens"] == tokens and got["trajectories"] == len(rows)
        assert close(got["kl"], want), (name, got, want)


def test_an_old_trajectory_without_its_task_gets_the_template_of_its_id():
    assert trajectory_template(member("t", "gen-count_lines-0123456789ab").trajectory) == (
        "count_lines"
    )
    assert trajectory_template(member("t", "eval-gen-a_b-0123456789ab").trajectory) == "a_b"
    assert trajectory_template(member("t", "seed-7").trajectory) == "seed-7"
    assert trajectory_template(member("t", "gen-x-0123456789ab", "disk_usage").trajectory) == (
        "disk_usage"
    )


def test_merged_ranks_keep_every_rows_kl():
    results = [step_result((("x", 1.0, 2),)), step_result((("y", 0.5, 1),))]
    assert merge_results(results).row_kl == (("x", 1.0, 2), ("y", 0.5, 1))


def step_result(row_kl) -> StepResult:
    return StepResult(
        step=1,
        lr=1e-3,
        stats={},
        grad_norm=0.0,
        parity_mean=0.0,
        parity_max=0.0,
        parity_tokens=0,
        sequences=1,
        tokens=1,
        duration_s=0.1,
        skipped_updates=0,
        row_kl=row_kl,
    )


def test_kl_of_given_sequences_is_the_direct_k3_sum_over_their_sampled_tokens():
    samples = group_samples_sharing(40, 5, seed=4)
    trainer = nudged_trainer()
    sequences = [
        KlSequence(
            prompt_ids=s.prompt_ids.tolist(),
            response_ids=s.response_ids.tolist(),
            loss_mask=s.loss_mask.tolist(),
        )
        for s in samples
    ]
    # at temperature 1, as sequences_kl scores them
    batch = build_batch([replace(s, temperatures=s.temperatures * 0 + 1) for s in samples], 0)
    expected = direct_row_kl(trainer, batch)
    before = [p.detach().clone() for p in trainer.params]
    got = sequences_kl(trainer, sequences, pad_token_id=0)
    assert [g.tokens for g in got] == [n for _, n in expected]
    for g, (want, _) in zip(got, expected):
        assert want > 0 and close(g.kl_sum, want), (g, want)
    assert all(torch.equal(p, q) for p, q in zip(trainer.params, before))  # weights untouched
    with pytest.raises(ValueError, match="differ in length"):
        sequences_kl(trainer, [KlSequence(prompt_ids=[5], response_ids=[6, 7], loss_mask=[1])], 0)
