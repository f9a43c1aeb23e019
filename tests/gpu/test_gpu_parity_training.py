"""Log-prob parity learner (bf16, float32 per-sequence log-probs) vs the engine (bf16) on GPU, and a
two-step training run with a weight push after each step (issue 9). Same procedure as
benchmarks/gpu_parity.py, on the small Qwen2 and fewer tokens."""

from __future__ import annotations

import copy

import pytest

from benchmarks.gpu_parity import gap, push, sample, score
from shellrl.clients.engine import EngineClient
from shellrl.weights import gpu as wtg
from tests.gpu.conftest import ENGINE_DEVICE, LEARNER_DEVICE, requires_cuda

torch = pytest.importorskip("torch")
pytestmark = requires_cuda

PROMPTS, NEW_TOKENS = 16, 128  # 2,048 sampled tokens per check


async def test_learner_and_engine_log_probs_agree_within_0_02_nats_in_bf16(
    learner_model, gpu_engine
):
    vocab = learner_model.config.vocab_size
    bucket = wtg.CudaIpcBucket(ENGINE_DEVICE)
    async with EngineClient(gpu_engine.url) as client:
        await push(learner_model, bucket, client, gpu_engine.url, 500)
        batch = (await sample(client, gpu_engine.url, PROMPTS, NEW_TOKENS, vocab, 11, 500)).to(
            LEARNER_DEVICE
        )
    bucket.close()
    parity = gap(score(learner_model, batch), batch)
    control = gap(score(learner_model, batch, temperature=1.0), batch)
    assert parity["tokens"] == PROMPTS * NEW_TOKENS
    assert parity["mean"] <= 0.02, parity
    assert control["mean"] > 3 * parity["mean"] and control["mean"] > 0.05, (
        parity,
        control,
    )  # discriminates


async def test_two_training_steps_with_weight_pushes_keep_learner_and_engine_in_parity(
    learner_model, gpu_engine
):
    from services.learner.trainer import Trainer
    from services.learner.trainer_config import TrainerConfig

    vocab = learner_model.config.vocab_size
    bucket = wtg.CudaIpcBucket(ENGINE_DEVICE)
    trainer = Trainer(learner_model, TrainerConfig(lr=1e-3, micro_batch_size=8, grad_clip_norm=1.0))
    async with EngineClient(gpu_engine.url) as client:
        url = gpu_engine.url
        await push(learner_model, bucket, client, url, 600)
        batch1 = await sample(
            client, url, PROMPTS, NEW_TOKENS, vocab, 21, 600
        )  # CPU batch, as the worker builds it
        stale = copy.deepcopy(learner_model)
        step1 = trainer.step(batch1, learner_version=600)
        await push(learner_model, bucket, client, url, 601)
        batch2 = await sample(client, url, PROMPTS, NEW_TOKENS, vocab, 22, 601)
        step2 = trainer.step(batch2, learner_version=601)
        assert (await client.get_weight_version(urls=[url]))[url] == "601"
    bucket.close()
    for step in (step1, step2):
        assert step.parity_tokens == PROMPTS * NEW_TOKENS and step.skipped_updates == 0
        assert step.parity_mean <= 0.02, step
        assert torch.isfinite(torch.tensor(step.grad_norm)) and step.grad_norm > 0
    batch2 = batch2.to(LEARNER_DEVICE)
    stale_gap = gap(score(stale, batch2), batch2)
    assert stale_gap["mean"] > 3 * step2.parity_mean, (
        stale_gap,
        step2,
    )  # the engine served the pushed weights
