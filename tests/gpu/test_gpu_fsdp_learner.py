"""The learner at world size 1 with FSDP2 on a GPU (issue 18, item 1; the 2-GPU run is a separate
issue): one rank in a process group of one (NCCL), the model sharded by `fully_shard`, driven
through DataParallel as rank 0 drives it under torchrun. It trains as the unsharded trainer does,
its torch.distributed.checkpoint restores it exactly, and its full weights, gathered parameter by
parameter, reach the engine over CUDA IPC intact (learner and engine log-probs agree).
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.gpu_parity import gap, sample
from services.learner.checkpoint import CheckpointStore, LearnerState
from services.learner.data_parallel import DataParallel
from services.learner.ranks import Ranks, init_ranks
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig
from services.learner.weights.weight_sync import WeightSync
from shellrl.clients.engine import EngineClient
from shellrl.models import load_model
from shellrl.rl.batch import TrainSample, build_batch
from tests.gpu.conftest import ENGINE_DEVICE, LEARNER_DEVICE, requires_cuda

torch = pytest.importorskip("torch")
pytestmark = requires_cuda
CONFIG = TrainerConfig(lr=1e-3, micro_batch_size=4, grad_clip_norm=1.0)


@pytest.fixture(scope="module")
def ranks():
    torch.cuda.set_device(LEARNER_DEVICE)
    group = init_ranks(fsdp="on", backend="auto", device="cuda", timeout_s=120, env={})
    yield group
    group.close()


def samples(n: int, seed: int, vocab: int) -> list[TrainSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p, r = int(rng.integers(8, 64)), int(rng.integers(8, 64))
        mask = np.ones(r, dtype=np.uint8)
        out.append(
            TrainSample(
                trajectory_id=f"t{seed}-{i}",
                prompt_ids=rng.integers(3, vocab, p),
                response_ids=rng.integers(3, vocab, r),
                behavior_logprobs=rng.normal(-8, 1, r).clip(max=0).astype(np.float32),
                loss_mask=mask,
                policy_versions=np.zeros(r, dtype=np.int64),
                temperatures=np.ones(r, np.float32),
                advantage=float(rng.normal()),
            )
        )
    return out


def test_fsdp2_at_world_size_1_trains_like_the_unsharded_trainer_and_resumes_exactly(
    ranks, gpu_model_dir, tmp_path
):
    def model():
        return load_model(str(gpu_model_dir), dtype=torch.float32, device=LEARNER_DEVICE)

    torch.manual_seed(0)
    plain = Trainer(model(), CONFIG, Ranks())
    sharded = Trainer(model(), CONFIG, ranks)
    assert sharded.sharded and not plain.sharded
    store = CheckpointStore(tmp_path / "ckpt")
    dp = DataParallel(sharded, store, pad_token_id=0)
    vocab = plain.model.config.vocab_size
    for k in range(2):
        batch = samples(8, k, vocab)
        want = plain.step(build_batch(batch, pad_token_id=0), k)
        got = dp.step(batch, k)
        assert got.tokens == want.tokens
        assert got.stats["policy_loss"] == pytest.approx(want.stats["policy_loss"], rel=1e-4)
    full = {n: t.clone() for n, t in dp.weights.named_parameters()}
    for name, p in plain.model.named_parameters():
        assert (full[name] - p.detach()).norm() <= 1e-5 * p.detach().norm(), name

    path = dp.save(LearnerState(step=2, version=2))
    fresh = Trainer(model(), CONFIG, ranks)
    resumed = DataParallel(fresh, store, pad_token_id=0)
    assert resumed.load(path).step == 2 and fresh.step_count == 2
    for name, tensor in resumed.weights.named_parameters():
        assert torch.equal(tensor, full[name]), name
    batch = samples(8, 7, vocab)  # the AdamW moments came back too: the next update is the same
    resumed.step(batch, 2)
    dp.step(batch, 2)
    after = dict(dp.weights.named_parameters())
    for name, tensor in resumed.weights.named_parameters():
        assert (tensor - after[name]).norm() <= 1e-6 * after[name].norm(), name


async def test_the_sharded_learners_gathered_weights_reach_the_engine_over_cuda_ipc_intact(
    ranks, gpu_model_dir, gpu_engine, tmp_path
):
    model = load_model(str(gpu_model_dir), dtype=torch.bfloat16, device=LEARNER_DEVICE)
    trainer = Trainer(model, CONFIG, ranks)
    dp = DataParallel(trainer, CheckpointStore(tmp_path / "ckpt"), pad_token_id=0)
    vocab = model.config.vocab_size
    dp.step(samples(8, 1, vocab), 0)  # weights that the engine does not have yet
    async with EngineClient(gpu_engine.url) as client:
        sync = WeightSync(
            client,
            None,
            transport="cuda_ipc",
            deadline_s=120,
            sync_dir=tmp_path / "sync",
            engine_device=ENGINE_DEVICE,
        )
        pushed = await sync.push(dp.weights, 800)
        assert pushed.confirmed == (gpu_engine.url,)
        batch = await sample(client, gpu_engine.url, 16, 64, vocab, 41, 800)
        sync.close()
    batch = batch.to(LEARNER_DEVICE)
    parity = gap(trainer.logprobs(batch), batch)
    assert parity["mean"] <= 0.02, parity
