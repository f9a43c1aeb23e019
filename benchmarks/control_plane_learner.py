"""The learner's intake for the control-plane benchmark: the real loop, a FAKE step.

The real `LearnerWorker` (services/learner/worker.py) runs: its StreamConsumer takes scored
trajectories from shellrl:trajectories (group "learner"), the real GroupAssembler checks and
assembles groups, staleness is checked on arrival and at training time, every
`groups_per_step` counted groups make a step, and each step's checkpoint acknowledges what it
resolved (checkpoint_interval_steps 1). Replaced, each named so:

* `FakeStepCompute` replaces DataParallel (the model, the optimizer, the ranks): a step sleeps
  `step_s` (default: the GPU job's median trained step, 1.27 s) and records the staleness of each
  trajectory it was handed (learner version - oldest policy version of its loss-mask tokens);
  `save` writes nothing.
* `FakeWeightSync` replaces the weight push: it tells every engine its new `weight_version`
  (`POST /update_weights_from_disk`, SGLang's body; the fake engines only relabel), then SETs
  and PUBLISHes shellrl:policy:version as the real WeightSync does once engines confirm.

Started with --start-paused it publishes version 0 and takes nothing until SIGUSR1 (the real
worker's pause and resume). Every second it writes its counters to `--stats` (JSON, replaced
atomically), which the harness reads at the edges of its measuring window.

    python -m benchmarks.control_plane_learner --redis-url URL [--shard-urls URL,...] \
        --engines URL,... --stats FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import numpy as np

from services.learner import metrics
from services.learner.checkpoint import CheckpointStore
from services.learner.group_assembler import DROP_REASONS, GroupAssembler
from services.learner.worker import LearnerWorker, WorkerConfig
from shellrl import streams
from shellrl.streams.keys import POLICY_UPDATES_CHANNEL, POLICY_VERSION_KEY
from shellrl.tracking import TrackingConfig


class FakeTrainer:
    """What LearnerWorker and DataParallel read of a Trainer: no model."""

    def __init__(self) -> None:
        self.step_count, self.lr, self.model, self.params = 0, 0.0, None, []
        self.sharded = False
        self.ranks = SimpleNamespace(world_size=1, rank=0, timeout_s=600.0)


class FakeStepCompute:
    """Replaces DataParallel (module docstring). `staleness`: Counter of versions trained."""

    def __init__(self, trainer: FakeTrainer, step_s: float) -> None:
        self.trainer, self.step_s = trainer, step_s
        self.weights = None
        self.staleness: Counter[int] = Counter()
        self.step_seconds: list[float] = []

    def step(self, samples, learner_version: int):
        start = time.monotonic()
        for s in samples:
            versions = np.asarray(s.policy_versions)[np.asarray(s.loss_mask) == 1]
            if versions.size:
                self.staleness[int(learner_version - versions.min())] += 1
        time.sleep(max(0.0, self.step_s - (time.monotonic() - start)))
        self.trainer.step_count += 1
        self.step_seconds.append(time.monotonic() - start)

    def skip_step(self) -> None:
        self.trainer.step_count += 1

    def save(self, state) -> Path:
        return Path(f"fake-step-{state.step}")

    def keepalive_due(self) -> bool:
        return False

    def stop(self) -> None:
        pass


class FakeWeightSync:
    """Replaces WeightSync (module docstring)."""

    def __init__(self, redis, engine_urls: list[str]) -> None:
        self.redis, self.engine_urls = redis, engine_urls
        self.http: aiohttp.ClientSession | None = None

    async def push(self, weights, version: int) -> None:
        self.http = self.http or aiohttp.ClientSession()
        body = {"model_path": "fake", "weight_version": str(version)}

        async def one(url: str) -> None:
            async with self.http.post(f"{url}/update_weights_from_disk", json=body) as r:
                r.raise_for_status()

        await asyncio.gather(*(one(u) for u in self.engine_urls))
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(POLICY_VERSION_KEY, version)
            pipe.publish(POLICY_UPDATES_CHANNEL, str(version))
            await pipe.execute()

    async def reconcile(self, weights, version: int) -> None:
        pass

    async def end_stale_sessions(self) -> None:
        """The fake engines keep no weight-update sessions."""

    async def publish_pending(self, version: int) -> bool:
        """Nothing waits to be published: push publishes each version at once."""
        return True

    def status(self) -> dict:
        return {}


def _write_stats(path: Path, worker: LearnerWorker, compute: FakeStepCompute) -> None:
    dropped = dict.fromkeys(DROP_REASONS, 0.0)
    for metric in metrics.DROPPED.collect():  # this counter only: a whole-registry collect
        for sample in metric.samples:  # costs the process more than its intake does
            if sample.name.endswith("_total"):
                dropped[sample.labels["reason"]] = sample.value
    body = {
        "time": time.monotonic(),
        "version": worker.version,
        "trained": worker.trained_total,
        "dropped": dropped,
        "staleness": dict(compute.staleness),
        "step_seconds": compute.step_seconds[-50:],
        "pending_groups": worker.assembler.pending_groups,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)


async def run(args: argparse.Namespace) -> None:
    redis = streams.connect(args.redis_url)
    shards = streams.StreamShards(redis, streams.shards.parse_shard_urls(args.shard_urls))
    consumer = shards.consumer(
        streams.STREAM_TRAJECTORIES,
        streams.GROUP_LEARNER,
        "learner-0",
        block_ms=1000,
        count=args.read_count,
        claim_min_idle_ms=600_000,
        max_deliveries=5,
    )
    assembler = GroupAssembler(group_timeout_s=120.0, max_staleness=args.max_staleness)
    trainer = FakeTrainer()
    config = WorkerConfig(
        groups_per_step=args.groups_per_step,
        checkpoint_interval_steps=1,
        read_count=args.read_count,
        tracking=TrackingConfig(backend="none"),
        start_paused=args.start_paused,
    )
    store = CheckpointStore(tempfile.mkdtemp(prefix="bench-cp-learner-"))
    sync = FakeWeightSync(redis, [u for u in args.engines.split(",") if u])
    worker = LearnerWorker(consumer, assembler, trainer, sync, store, config)
    worker.shards = shards
    compute = worker.data_parallel = FakeStepCompute(trainer, args.step_s)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    # SIGUSR1: what POST /v1/resume does (the drain measurement starts a paused learner)
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, worker.resume_training)

    async def report() -> None:
        while not stop.is_set():
            _write_stats(Path(args.stats), worker, compute)
            await asyncio.sleep(1.0)  # a sampling period, not a wait for a condition

    reporter = asyncio.create_task(report())
    try:
        await worker.run(stop)
    finally:
        reporter.cancel()
        await worker.close_streams()
        shutil.rmtree(store.directory, ignore_errors=True)
    _write_stats(Path(args.stats), worker, compute)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.control_plane_learner", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--redis-url", required=True)
    parser.add_argument(
        "--shard-urls", default="", help="stream shards' Redis URLs, comma-separated (shards.py)"
    )
    parser.add_argument("--engines", default="", help="engine URLs, comma-separated")
    parser.add_argument("--stats", required=True, help="JSON file of counters, every second")
    parser.add_argument("--groups-per-step", type=int, default=4)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--step-s", type=float, default=1.27)
    parser.add_argument("--read-count", type=int, default=256)
    parser.add_argument(
        "--start-paused", action="store_true", help="take no step until SIGUSR1 (resume)"
    )
    parser.add_argument("--cprofile", help="write cProfile stats (CPU time) of the run here")
    args = parser.parse_args(argv)
    if args.cprofile:
        import cProfile

        with cProfile.Profile(time.process_time) as profiler:
            asyncio.run(run(args))
        profiler.dump_stats(args.cprofile)
    else:
        asyncio.run(run(args))


if __name__ == "__main__":
    main()
