"""Checkpoint/resume of weights, AdamW moments and LR schedule (known_pitfalls C35)."""

import pytest
import torch

from services.learner.checkpoint import CheckpointStore, LearnerState, surviving_steps
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig
from shellrl.models import load_model
from shellrl.rl.batch import build_batch
from tests.unit.test_rl_logprobs import make_samples


def batches():
    return [build_batch(make_samples(4, seed=s), pad_token_id=2) for s in range(7)]


def test_resume_at_step_5_continues_lr_and_update_like_an_uninterrupted_run(tmp_path):
    config = TrainerConfig(lr=1e-6, warmup_steps=10, micro_batch_size=2)
    data = batches()
    torch.manual_seed(0)
    model = load_model("tiny")
    trainer = Trainer(model, config)
    for b in data[:5]:
        trainer.step(b, learner_version=trainer.step_count)
    store = CheckpointStore(tmp_path, keep=2)
    path = store.save(trainer, LearnerState(step=5, version=5, consumed_ids=["a", "b"]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    uninterrupted = trainer.step(data[5], learner_version=5)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    fresh = load_model("tiny")
    resumed = Trainer(fresh, config)
    state = store.load(store.latest(), resumed)
    assert path == store.latest() and state.step == 5 and state.consumed_ids == ["a", "b"]
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())
    assert resumed.lr == pytest.approx(6e-7)  # not 1e-7 (warmup restarted) nor 7e-7 (stepped twice)
    result = resumed.step(data[5], learner_version=5)
    assert (
        result.lr == pytest.approx(6e-7)
        and uninterrupted.lr == pytest.approx(6e-7)
        and result.step == 6
    )
    for k, v in fresh.state_dict().items():
        delta_expected = expected[k] - before[k]
        delta = v - before[k]
        assert (delta - delta_expected).abs().max() <= 1e-6 * delta_expected.abs().max() + 1e-12, k


def test_only_complete_checkpoints_are_listed_and_old_ones_are_pruned(tmp_path):
    model = load_model("tiny")
    trainer = Trainer(model, TrainerConfig())
    store = CheckpointStore(tmp_path, keep=2)
    (tmp_path / ".tmp-step-000009-123").mkdir()  # a crash in the middle of a save
    for step in (1, 2, 3):
        store.save(trainer, LearnerState(step=step, version=step))
    assert [p.name for p in store.checkpoints()] == ["step-000002", "step-000003"]
    assert (store.latest() / "model.safetensors").exists() and (
        store.latest() / "config.json"
    ).exists()


def test_ledger_keeps_the_surviving_history_after_a_resume(tmp_path):
    store = CheckpointStore(tmp_path)
    for step, ids in [(1, ["a"]), (2, ["b"]), (3, ["c"])]:
        store.append_ledger({"step": step, "trajectory_ids": ids})
    store.append_ledger({"event": "resume", "step": 2})
    store.append_ledger({"step": 3, "trajectory_ids": ["c", "d"]})
    steps = surviving_steps(store.read_ledger())
    assert {s: r["trajectory_ids"] for s, r in steps.items()} == {1: ["a"], 2: ["b"], 3: ["c", "d"]}
