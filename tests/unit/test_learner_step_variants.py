"""The faster learner step of issue 33 item 3 against the step before it, on the real tiny model:
AdamW's fused kernel takes the per-tensor loop's update (to float rounding), and a reference run
under bfloat16 autocast changes the loss and the gradient within the stated tolerance while the LM
head stays float32. The SmolLM2 numbers (speed and the same comparisons) are in BENCHMARKS.md,
"Learning that transfers (issue 33)", from benchmarks/bench_learner_step.py."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from benchmarks.bench_learner_step import first_step_terms, reference_logprobs
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig
from shellrl.models import load_model
from shellrl.rl.batch import build_batch
from shellrl.rl.logprobs import head_logprobs, token_logprobs
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
# a bfloat16 reference against the float32 one: what the step may change (stated in BENCHMARKS.md)
REF_LOGPROB_TOL = 0.05  # nats, max over scored tokens
LOSS_REL_TOL = 1e-3  # |loss difference| / |loss|
GRAD_COS_MIN = 0.999


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread, as the main job's learner runs: on a loaded 2-core machine a second
    thread makes these tiny-model steps several times slower, not faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def trainers(*configs: TrainerConfig) -> list[Trainer]:
    """Trainers of the same initial tiny model, one per config; the reference differs from the
    policy (one SGD-sized nudge of the policy) so that the KL term has a gradient."""
    model = load_model("tiny")
    out = []
    for cfg in configs:
        trainer = Trainer(copy.deepcopy(model), cfg)
        with torch.no_grad():
            for i, p in enumerate(trainer.params):
                p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
        out.append(trainer)
    return out


def test_fused_adamw_takes_the_per_tensor_loops_step():
    batch = build_batch(group_samples_sharing(40, 4, seed=5), pad_token_id=2)
    loop, fused = trainers(replace(JOB, fused_optimizer=False), JOB)
    assert fused.optimizer.param_groups[0]["fused"] and not loop.optimizer.param_groups[0]["fused"]
    for _ in range(2):  # the second step uses the moments of the first
        a, b = loop.step(batch, 0), fused.step(batch, 0)
        assert abs(a.stats["policy_loss"] - b.stats["policy_loss"]) < 1e-6
    for p, q in zip(loop.params, fused.params):
        assert (p - q).abs().max() < 1e-6  # lr 1e-3: an update moves a weight by ~1e-3


def test_a_bfloat16_reference_changes_the_loss_and_gradient_within_the_tolerance():
    batch = build_batch(group_samples_sharing(40, 8, seed=9), pad_token_id=2)
    fp32, bf16 = trainers(JOB, replace(JOB, reference_dtype="bfloat16"))
    scored = batch.loss_mask > 0
    d = (reference_logprobs(bf16, batch) - reference_logprobs(fp32, batch))[scored].abs()
    assert 0 < float(d.max()) < REF_LOGPROB_TOL  # it did run in bfloat16, close to float32
    a, b = first_step_terms(fp32, batch), first_step_terms(bf16, batch)
    assert a["kl"] > 0 and abs(a["loss"] - b["loss"]) <= LOSS_REL_TOL * abs(a["loss"])
    cos = torch.nn.functional.cosine_similarity(a["grad"].double(), b["grad"].double(), dim=0)
    assert float(cos) >= GRAD_COS_MIN


def test_the_lm_head_stays_float32_under_bfloat16_autocast():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(5, 16, generator=g), torch.randn(40, 16, generator=g)
    args = (hidden, weight, None, torch.tensor([1, 2, 3, 4, 5]), torch.full((5,), 0.7))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = head_logprobs(*args)
    assert inside.dtype == torch.float32 and torch.equal(inside, head_logprobs(*args))


def test_an_unknown_reference_dtype_is_refused_naming_the_choices():
    try:
        replace(JOB, reference_dtype="float16")
    except ValueError as exc:
        assert "bfloat16" in str(exc) and "float16" in str(exc)
    else:
        raise AssertionError("float16 was accepted")


def test_unpadded_rows_after_the_shared_prefix_give_the_padded_log_probs_and_gradients():
    model = load_model("tiny")
    model.train()
    batch = build_batch(group_samples_sharing(40, 4, seed=11), pad_token_id=2)
    assert len(set(batch.lengths.tolist())) > 1  # rows of different lengths: padding to cut
    values, grads = [], []
    for unpadded in (False, True):
        model.zero_grad(set_to_none=True)
        lp = token_logprobs(model, batch, share_prefix_min_tokens=16, unpadded_rows=unpadded)
        (lp * batch.advantages).sum().backward()
        values.append(lp.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert (values[0] - values[1]).abs().max() < 1e-5
    assert (grads[0] - grads[1]).abs().max() < 1e-5 * grads[0].abs().max()
