"""Log-probs and the trainer's micro-batch invariance on the real tiny model (2-layer Llama)."""

from dataclasses import replace

import numpy as np
import pytest
import torch

from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig
from shellrl.models import load_model
from shellrl.rl.batch import TrainSample, build_batch
from shellrl.rl.logprobs import enable_gradient_checkpointing, shared_prefix_length, token_logprobs
from shellrl.rl.losses import PPOConfig


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def make_samples(n, seed=0, temperature=0.7):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(3, 12)), int(rng.integers(2, 15))
        mask = np.ones(r, dtype=np.uint8)
        if r > 5:
            mask[2:4] = 0  # an observation inside the response
        out.append(
            TrainSample(
                trajectory_id=f"t{i}",
                prompt_ids=rng.integers(3, 49000, p),
                response_ids=rng.integers(3, 49000, r),
                behavior_logprobs=np.where(mask > 0, rng.normal(-10, 1, r), 0).astype(np.float32),
                loss_mask=mask,
                policy_versions=np.where(mask > 0, 0, -1),
                temperatures=np.full(r, temperature, np.float32),
                advantage=float(rng.normal()),
            )
        )
    return out


def test_logprobs_are_temperature_scaled_log_softmax_at_the_shifted_position(tiny):
    s = make_samples(1, temperature=0.6)[0]
    batch = build_batch([s], pad_token_id=2)
    with torch.no_grad():
        got = token_logprobs(tiny, batch)
        ids = torch.as_tensor(np.concatenate([s.prompt_ids, s.response_ids]))[None]
        logits = tiny(input_ids=ids).logits[0].float()
        p = len(s.prompt_ids)
        ref = (
            torch.log_softmax(logits / 0.6, -1)[p - 1 : -1].gather(-1, ids[0, p:, None]).squeeze(-1)
        )
        at_t1 = torch.log_softmax(logits, -1)[p - 1 : -1].gather(-1, ids[0, p:, None]).squeeze(-1)
    mask = torch.as_tensor(s.loss_mask, dtype=torch.bool)
    scored = got[0, p - 1 : p - 1 + len(s.response_ids)]
    assert (scored[mask] - ref[mask]).abs().max() < 1e-5
    assert (scored[~mask] == 0).all()
    assert (ref[mask] - at_t1[mask]).abs().mean() > 1e-3  # the check tells temperatures apart


def test_logprobs_do_not_depend_on_padding_or_batch_company(tiny):
    samples = make_samples(3, seed=1)
    long = TrainSample(
        "long",
        np.arange(3, 203),
        np.arange(300, 400),
        np.zeros(100, np.float32),
        np.ones(100, np.uint8),
        np.zeros(100, np.int64),
        np.ones(100, np.float32),
        1.0,
    )
    with torch.no_grad():
        alone = token_logprobs(tiny, build_batch(samples[:1], pad_token_id=2))
        padded = token_logprobs(
            tiny, build_batch([samples[0], long], pad_token_id=2, pad_to_multiple_of=64)
        )
        chunked = token_logprobs(tiny, build_batch(samples[:1], pad_token_id=2), chunk_tokens=2)
    w = alone.shape[1]
    assert (alone[0] - padded[0, :w]).abs().max() < 1e-5
    assert padded[0, w:].abs().sum() == 0
    assert (alone - chunked).abs().max() < 1e-6


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_loss_and_gradients_do_not_depend_on_the_micro_batch_size(tiny, aggregation):
    batch = build_batch(make_samples(6, seed=2), pad_token_id=2)
    state = {k: v.clone() for k, v in tiny.state_dict().items()}
    results = []
    for mb in (1, 2, 6):
        tiny.load_state_dict(state)
        trainer = Trainer(
            tiny,
            TrainerConfig(
                micro_batch_size=mb,
                ppo_epochs=1,
                grad_clip_norm=0.0,
                loss=PPOConfig(aggregation=aggregation),
            ),
        )
        captured = []  # gradients at the clip, before the update
        trainer._clip = lambda c=captured, t=trainer: (
            c.append(torch.cat([p.grad.flatten() for p in t.params])) or 0.0
        )
        result = trainer.step(batch, learner_version=0)
        grads = captured[0]
        results.append((result.stats["policy_loss"], grads))
    tiny.load_state_dict(state)
    (loss1, g1), (loss2, g2), (loss6, g6) = results
    assert abs(loss1 - loss2) < 1e-6 and abs(loss1 - loss6) < 1e-6
    assert (g1 - g2).abs().max() < 1e-6 and (g1 - g6).abs().max() < 1e-6
    assert g1.abs().max() > 1e-4  # the comparison is not between zeros


def test_proximal_logprobs_from_the_first_epoch_equal_a_separate_no_grad_pass(tiny):
    batch = build_batch(make_samples(4, seed=3), pad_token_id=2)
    state = {k: v.clone() for k, v in tiny.state_dict().items()}
    trainer = Trainer(tiny, TrainerConfig(micro_batch_size=2, ppo_epochs=2, lr=1e-2))
    separate = trainer.logprobs(batch)  # what a separate proximal pass would give
    fresh = replace(
        batch,
        behavior_logprobs=separate,
        policy_versions=torch.where(
            batch.loss_mask > 0, torch.zeros_like(batch.policy_versions), batch.policy_versions
        ),
    )
    result = trainer.step(fresh, learner_version=0)
    tiny.load_state_dict(state)
    assert result.parity_tokens == int(batch.loss_mask.sum())
    assert (
        result.parity_max <= 1e-6
    )  # two forward passes (with and without grad): a float tolerance
    assert result.stats["ratio_max"] != 1.0  # the second epoch ran on updated weights


def group_samples_sharing(prompt_len: int, n: int, seed: int = 3) -> list:
    """A GRPO group: one prompt, n responses that agree on their first 2 tokens (scored) and then differ."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, 49000, prompt_len)
    out = []
    for i in range(n):
        response = np.concatenate([[77, 78], rng.integers(3, 49000, int(rng.integers(2, 12)))])
        r = len(response)
        mask = np.ones(r, np.uint8)
        mask[3:5] = 0  # an observation
        out.append(
            TrainSample(
                f"g{i}",
                prompt,
                response,
                np.zeros(r, np.float32),
                mask,
                np.where(mask > 0, 0, -1),
                np.full(r, 0.7, np.float32),
                float(rng.normal()),
            )
        )
    return out


def test_a_shared_prefix_run_once_gives_the_full_forwards_log_probs_and_gradients(tiny):
    batch = build_batch(group_samples_sharing(30, 4), pad_token_id=2)
    assert shared_prefix_length(batch) == 32  # the prompt and the 2 shared (scored) response tokens
    grads = []
    values = []
    for share in (0, 8):
        tiny.zero_grad()
        lp = token_logprobs(tiny, batch, share_prefix_min_tokens=share)
        (lp * torch.linspace(0.5, 2.0, lp.numel()).reshape(lp.shape)).sum().backward()
        values.append(lp.detach())
        grads.append([p.grad.clone() for p in tiny.parameters()])
    tiny.zero_grad()
    assert (values[0] - values[1]).abs().max() < 1e-5
    assert (values[0][batch.loss_mask == 0] == 0).all() and (
        values[1][batch.loss_mask == 0] == 0
    ).all()
    for full, shared in zip(*grads):
        assert (full - shared).abs().max() <= 1e-5 * max(1.0, float(full.abs().max()))


def test_shared_prefix_length_needs_two_rows_the_same_tokens_and_a_token_of_each_rows_own():
    samples = group_samples_sharing(10, 3)
    assert shared_prefix_length(build_batch(samples[:1], pad_token_id=2)) == 0
    other = replace(samples[1], prompt_ids=np.concatenate([[9], samples[1].prompt_ids[1:]]))
    assert shared_prefix_length(build_batch([samples[0], other], pad_token_id=2)) == 0
    same = [samples[0], replace(samples[0], trajectory_id="copy")]
    assert (
        shared_prefix_length(build_batch(same, pad_token_id=2))
        == len(samples[0].prompt_ids) + len(samples[0].response_ids) - 1
    )


def test_trainer_steps_with_and_without_prefix_sharing_reach_the_same_weights():
    batch = build_batch(group_samples_sharing(40, 4, seed=5), pad_token_id=2)
    weights, decoder_batch_sizes = [], []
    for share, unpadded in ((0, False), (16, False), (16, True)):
        model = load_model("tiny")
        sizes: list[int] = []
        model.get_decoder().register_forward_pre_hook(
            lambda _m, _args, kwargs: sizes.append(int(kwargs["input_ids"].shape[0])),
            with_kwargs=True,
        )
        trainer = Trainer(
            model,
            TrainerConfig(
                lr=1e-3,
                micro_batch_size=2,
                gradient_checkpointing=False,
                share_prefix_min_tokens=share,
                unpadded_rows=unpadded,
            ),
        )
        trainer.step(batch, learner_version=0)
        weights.append([p.detach().clone() for p in model.parameters()])
        decoder_batch_sizes.append(sizes)
    assert decoder_batch_sizes == [
        [2, 2],
        [1, 2, 1, 2],
        [1, 1, 1, 1, 1, 1],
    ]  # the shared runs: each micro-batch's prefix at batch 1, then its rows padded or each alone
    for unshared, shared, unpadded in zip(*weights):
        assert (unshared - shared).abs().max() < 1e-5
        assert (unshared - unpadded).abs().max() < 1e-5


def test_under_activation_checkpointing_the_full_forward_runs_and_values_are_unchanged():
    model = load_model("tiny")
    model.train()
    enable_gradient_checkpointing(model)
    batch = build_batch(group_samples_sharing(40, 4, seed=7), pad_token_id=2)
    with torch.no_grad():
        full = token_logprobs(model, batch)
        requested = token_logprobs(model, batch, share_prefix_min_tokens=8)
    assert torch.equal(full, requested)  # bit for bit: the same (full) forward ran
