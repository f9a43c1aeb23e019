"""One RL run done twice on the same seeds and tasks, for the test that async at max_staleness 0
is synchronous (issue 18, item 5): strictly synchronously, and through the asynchronous pipeline.

Task i is the i-th group: prompt PROMPTS[i % len], GROUP_SIZE samples from the engine with
sampling seeds 1000 * i + j, rewards from the sampled tokens (`reward`).

* `synchronous_run`: step k samples tasks 2k and 2k+1 with the engine at version k, computes GRPO
  advantages, takes one Trainer step and pushes version k + 1: the learner's pieces in one loop.
* `asynchronous_run`: the learner's own loop (LearnerWorker from the service's build_worker)
  against Redis, fed by concurrent rollout workers that take admission from the gateway's real
  Admission (staleness bound at max_staleness), sample their group from the engine as it is
  then, publish it to shellrl:trajectories and finish the ticket.
The engine must decode one request at a time (max_running_requests 1) without a prefix cache,
so that a seeded request gives the same tokens whatever runs beside it.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from services.learner.checkpoint import surviving_steps
from services.learner.group_assembler import GroupAssembler
from services.learner.parts import build_worker, trainer_config
from services.learner.settings import LearnerSettings
from services.learner.train_samples import group_samples
from services.learner.trainer import Trainer
from services.learner.weights.weight_sync import WeightSync
from services.rollout.admission import Admission
from services.rollout.policy_version import PolicyVersionWatcher
from shellrl import streams
from shellrl.contract import (
    SamplingParams,
    Trajectory,
    action_segment,
    encode_token_ids,
    parse_trajectory,
)
from shellrl.models import load_model, load_tokenizer
from shellrl.rl.batch import build_batch
from shellrl.service.aio import cancel_and_wait
from tests.helpers.trajectories import engine_version
from tests.helpers.waiting import wait_until_async

PROMPTS = ([1, 9690, 28, 253, 1061, 30], [1, 4093, 314, 260, 2030, 30, 216], [1, 339, 2643, 30])
GROUP_SIZE, GROUPS_PER_STEP, MAX_NEW_TOKENS = 4, 2, 4


def settings(redis_url: str, engine_url: str, tmp: Path) -> LearnerSettings:
    return LearnerSettings(
        model_path="tiny",
        engine_urls=engine_url,
        redis_url=redis_url,
        checkpoint_dir=str(tmp / "ckpt"),
        weight_sync_dir=str(tmp / "sync"),
        groups_per_step=GROUPS_PER_STEP,
        max_staleness=0,
        group_timeout_s=600,
        lr=1e-3,
        micro_batch_size=2,
        num_threads=1,
        block_ms=200,
        checkpoint_interval_steps=100,
        weight_sync_timeout_s=30,
        auth_disabled=True,
    )


def reward(output_ids: list[int]) -> float:
    return (sum(output_ids) % 10) / 9.0


async def sample_task(client, index: int) -> list[Trajectory]:
    """Task `index`: GROUP_SIZE seeded samples from the engine as it is now."""
    prompt = PROMPTS[index % len(PROMPTS)]
    out = []
    for j in range(GROUP_SIZE):
        sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
        sampling |= {"max_new_tokens": MAX_NEW_TOKENS, "sampling_seed": 1000 * index + j}
        r = await client.generate(prompt, sampling)
        segment = action_segment(
            r.output_ids,
            r.output_logprobs,
            engine_version(r.weight_version),
            sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4),
        )
        out.append(
            Trajectory(
                trajectory_id=f"task{index}-{j}",
                group_id=f"task{index}",
                group_size=GROUP_SIZE,
                prompt_ids=encode_token_ids(prompt),
                segments=[segment],
                reward=reward(r.output_ids),
                training_reward=reward(r.output_ids),
                scored=True,
                task_id=f"task{index}",
            )
        )
    return out


@dataclass
class Run:
    """batches: per step, the trajectory ids trained; trajectories: every one sampled, by id;
    weights: the final parameters by name."""

    batches: list[set[str]]
    trajectories: dict[str, Trajectory]
    weights: dict[str, torch.Tensor]


async def synchronous_run(s: LearnerSettings, client, steps: int, sync_dir: Path) -> Run:
    torch.manual_seed(s.seed)
    model = load_model(s.model_path, dtype=torch.float32)
    pad = load_tokenizer(s.model_path).pad_token_id
    trainer = Trainer(model, trainer_config(s))
    sync = WeightSync(client, None, transport="shm", deadline_s=30, sync_dir=sync_dir)
    assembler = GroupAssembler(group_timeout_s=600, max_staleness=0)
    await sync.push(model, 0)
    batches, trajectories = [], {}
    for k in range(steps):
        for i in range(GROUPS_PER_STEP * k, GROUPS_PER_STEP * (k + 1)):
            for t in await sample_task(client, i):
                trajectories[t.trajectory_id] = t
                assert assembler.add(t.trajectory_id, t, k) is None
        samples = []
        for group in assembler.pop_ready(k):
            out = group_samples(group)
            samples += [] if out.zero_variance else out.samples
        batches.append({x.trajectory_id for x in samples})
        if samples:
            trainer.step(build_batch(samples, pad, s.pad_to_multiple_of), k)
        else:
            trainer.skip_step()
        await sync.push(model, k + 1)
    sync.close()
    return Run(batches, trajectories, {n: p.detach().clone() for n, p in model.named_parameters()})


async def asynchronous_run(s: LearnerSettings, client, steps: int, rollout_workers: int) -> Run:
    redis = streams.connect(s.redis_url)
    worker, learner_client = await asyncio.to_thread(build_worker, s, redis)
    stop = asyncio.Event()
    learner = asyncio.create_task(worker.run(stop))
    watcher = PolicyVersionWatcher(redis, poll_s=0.2)
    watching = asyncio.create_task(watcher.run())
    try:  # the engine serves the learner's initial weights once version 0 is published
        await wait_until_async(lambda: redis.get(streams.POLICY_VERSION_KEY), 60, "version 0")
        admission = Admission(
            redis, watcher, replica="test", max_staleness=s.max_staleness, groups_per_step=2
        )
        producer = streams.StreamProducer(redis, streams.STREAM_TRAJECTORIES)

        async def rollout() -> None:
            while True:
                ticket = await admission.admit(uuid.uuid4().hex)
                index = ticket.admitted - 1  # the admission order is the task order
                if index >= GROUPS_PER_STEP * steps:
                    return
                for t in await sample_task(client, index):
                    await producer.add(
                        t.SerializeToString(), idempotency_key=t.trajectory_id, group_id=t.group_id
                    )
                await admission.finish(ticket, usable=GROUP_SIZE)

        workers = [asyncio.create_task(rollout()) for _ in range(rollout_workers)]
        await wait_until_async(
            lambda: (
                worker.completed_step >= steps or any(w.done() and w.exception() for w in workers)
            ),
            180,
            f"step {steps}",
        )
        await cancel_and_wait(*workers)  # those still waiting for admission to a later version
        for w in workers:
            if not w.cancelled() and w.exception():
                raise w.exception()
    finally:
        stop.set()
        await asyncio.wait_for(learner, 60)
        await cancel_and_wait(watching)
        worker.sync.close()
        await learner_client.close()
    entries = await redis.xrange(streams.STREAM_TRAJECTORIES)
    await redis.aclose()
    ledger = surviving_steps(worker.store.read_ledger())
    return Run(
        [set(ledger[k + 1]["trajectory_ids"]) for k in range(steps)],
        {t.trajectory_id: t for t in (parse_trajectory(f[b"pb"]) for _, f in entries)},
        {n: p.detach().clone() for n, p in worker.trainer.model.named_parameters()},
    )
