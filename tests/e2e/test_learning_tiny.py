"""Learning on a trivially learnable task, end to end on CPU: the real engine process samples
(tiny model, top-k 20, T = 1, one new token), the learner's own path trains (GroupAssembler,
GRPO advantages, batch builder, Trainer) and pushes every step's weights back to the engine
through shared memory (WeightSync). Reward 1 when the answer is a fixed one-token string.

The target is the token ranked 10th of the top 20 under the initial weights, so the success
rate starts near 1/20 and must reach >= 0.8 within 30 steps (it does in about 10-12).
"""

from __future__ import annotations

import statistics

import pytest
import torch

from services.learner.group_assembler import GroupAssembler
from services.learner.train_samples import group_samples
from services.learner.trainer import Trainer
from services.learner.trainer_config import TrainerConfig
from services.learner.weights.weight_sync import WeightSync
from shellrl.clients.engine import EngineClient
from shellrl.models import load_model
from shellrl.rl.batch import build_batch
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port
from tests.helpers.trajectories import sample_group

pytestmark = pytest.mark.slow
PROMPT = [1, 9690, 28, 253, 1061, 30]
GROUP_SIZE, GROUPS_PER_STEP, TOP_K, MAX_STEPS = 8, 4, 20, 30


async def test_success_rate_rises_from_near_zero_to_at_least_080_on_a_fixed_answer(tmp_path):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    engine = ServiceProcess(
        "engine", free_port(), {"SHELLRL_MODEL_PATH": "tiny", "SHELLRL_NUM_THREADS": "1"}, tmp_path
    ).start(ready_timeout_s=180)
    client = EngineClient([engine.url], timeout_s=120)
    try:
        model = load_model("tiny")
        with torch.no_grad():
            last_logits = model(input_ids=torch.tensor([PROMPT])).logits[0, -1]
        target = int(torch.topk(last_logits, TOP_K).indices[10])
        trainer = Trainer(model, TrainerConfig(lr=1e-2, micro_batch_size=32))
        sync = WeightSync(client, None, transport="shm", deadline_s=30, sync_dir=tmp_path / "sync")
        assembler = GroupAssembler(group_timeout_s=60, max_staleness=0)
        history, parity = [], []
        for step in range(MAX_STEPS):
            version = trainer.step_count
            trajectories = []
            for g in range(GROUPS_PER_STEP):
                trajectories += await sample_group(
                    client,
                    PROMPT,
                    f"s{step}-g{g}",
                    GROUP_SIZE,
                    temperature=1.0,
                    max_new_tokens=1,
                    top_k=TOP_K,
                    reward_fn=lambda ids: ids[:1] == [target],
                )
            assert {t.segments[0].policy_version for t in trajectories} == {
                version
            }  # the pushed weights sampled
            history.append(statistics.mean(t.reward for t in trajectories))
            for i, t in enumerate(trajectories):
                assert assembler.add(f"{step}-{i}", t, version) is None
            samples = []
            for group in assembler.pop_ready(version):
                out = group_samples(group)
                if not out.zero_variance:
                    samples += out.samples
            if samples:
                result = trainer.step(build_batch(samples, pad_token_id=2), version)
                parity.append(result.parity_max)
            else:
                trainer.skip_step()
            pushed = await sync.push(model, trainer.step_count)
            assert pushed.confirmed == (engine.url,)
            if len(history) >= 3 and statistics.mean(history[-3:]) >= 0.8:
                break
        print("success per step", [round(h, 3) for h in history])
        assert history[0] <= 0.2, history
        assert statistics.mean(history[-3:]) >= 0.8, history
        assert max(parity) <= 1e-4  # every step trained on tokens its own weights sampled
    finally:
        await client.close()
        engine.stop()
