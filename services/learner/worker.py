"""The learner's stream loop: take scored trajectories, assemble groups, train, push, checkpoint, ack.

    shellrl:trajectories (group "learner") ─▶ intake: parse, skip consumed ids, GroupAssembler
      ─▶ groups_per_step counted groups ─▶ GRPO advantages ─▶ TrainSamples ─▶ DataParallel.step
         (every rank trains its share: data_parallel.py) ─▶ WeightSync.push (version = step)
      ─▶ every checkpoint_interval steps: checkpoint (every rank's part), then XACK every entry
         the checkpointed steps resolved (trained or dropped)

This loop runs on rank 0 only; at world size 1 it is the whole learner.

Guarantees: an entry is acknowledged only after a durable checkpoint includes the step that
resolved it; after a crash the same consumer name re-reads its pending entries, skips (and
acknowledges) those a checkpoint already covers, and trains the rest again, so no trajectory is
lost and none trains twice in the surviving history (steps.jsonl, checkpoint.surviving_steps;
the bookkeeping is acks.py's).
The version advances once per `groups_per_step` counted groups even when none of them is
trainable (all zero variance or stale): the weights are then unchanged but the step, the LR
schedule and the published version move on, in step with the gateway's admission count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.learner import metrics
from services.learner.acks import AckLedger
from services.learner.checkpoint import CheckpointStore, LearnerState
from services.learner.data_parallel import DataParallel
from services.learner.group_assembler import Dropped, GroupAssembler, RolloutGroup
from services.learner.sample_table import COLUMNS, SampleTable
from services.learner.step_metrics import step_record
from services.learner.train_samples import group_samples
from services.learner.trainer import Trainer
from services.learner.weights.weight_sync import WeightSync
from shellrl.contract import ContractError, parse_trajectory
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import ShardedStreamConsumer, StreamConsumer, StreamEntry, StreamShards
from shellrl.tracking import Tracker, TrackingConfig, create_tracker, flatten

log = logging.getLogger(__name__)

FINAL_CHECKPOINT_S = 30.0  # drain: time for the last checkpoint on top of the grace period


@dataclass(frozen=True)
class WorkerConfig:
    groups_per_step: int
    checkpoint_interval_steps: int
    train_zero_variance_groups: bool = False
    overlong_filtering: bool = False
    fixed_temperature: float | None = None
    pad_token_id: int = 0
    pad_to_multiple_of: int = 1
    read_count: int = 64
    fault_oom_at_step: int = 0  # fault drill: `allocate_past_device_memory` before this step
    start_paused: bool = False  # train only after POST /v1/resume
    max_steps: int = 0  # pause at this policy version (0: never); the default `step_target`
    # experiment tracking of every step's metrics (shellrl/tracking.py); its directory defaults
    # to <checkpoint_dir>/../tracking (the TensorBoard run: .../tracking/learner)
    tracking: TrackingConfig = TrackingConfig()
    # the resolved settings, logged to the tracker (and <run>/config.json) at every start
    run_config: Mapping = field(default_factory=dict)


class LearnerWorker:
    def __init__(
        self,
        consumer: StreamConsumer | ShardedStreamConsumer,
        assembler: GroupAssembler,
        trainer: Trainer,
        sync: WeightSync,
        store: CheckpointStore,
        config: WorkerConfig,
        tracker: Tracker | None = None,
        samples: SampleTable | None = None,
    ) -> None:
        self.consumer, self.assembler, self.trainer, self.sync = consumer, assembler, trainer, sync
        self.store, self.config = store, config
        self.data_parallel = DataParallel(
            trainer,
            store,
            pad_token_id=config.pad_token_id,
            pad_to_multiple_of=config.pad_to_multiple_of,
        )
        self.tracker = tracker or create_tracker(
            config.tracking, "learner", Path(store.directory).parent / "tracking"
        )
        self.samples = samples  # a table of sampled episodes every N steps (None: never)
        self._staleness: list[int] = []  # of the trajectories trained in the step in progress
        self.acks = AckLedger()  # what a checkpoint lets the worker acknowledge (acks.py)
        self.shards: StreamShards | None = None  # the stream shards' clients (closed by aclose)
        self.ready: list[RolloutGroup] = []  # released groups waiting for a step
        self.completed_step = 0  # what /v1/status reports: steps whose record is complete
        # set once `resume` has restored the newest checkpoint and pushed its weights: /readyz
        # waits for it, so nothing evaluates the engine before it serves the resumed policy
        self.resumed = asyncio.Event()
        self.resumed_step: int | None = None  # the checkpoint's step `resume` restored, if any
        self.last: dict = {}
        self.started_s, self.trained_total = time.monotonic(), 0
        self.step_target = config.max_steps  # pause at this version (0: never): resume_training
        self.running = asyncio.Event()
        if not config.start_paused:
            self.running.set()
        self.paused_idle = asyncio.Event()  # set while paused with no step or push in progress
        self._checkpoint_requests: list[asyncio.Future] = []
        self._run_task: asyncio.Task | None = None  # the task running `run` (awaited by `drain`)

    @property
    def version(self) -> int:
        return self.trainer.step_count

    async def run(self, stop: asyncio.Event) -> None:
        """The loop (see the module docstring) until `stop`; then a last checkpoint, which
        acknowledges every entry resolved since the one before (see `drain`)."""
        self._run_task = asyncio.current_task()
        await self.consumer.ensure_group()
        await self.resume()
        self.tracker.log_config(self.config.run_config, self.version)
        while not stop.is_set():
            await self.serve_checkpoint_requests()
            if self.data_parallel.keepalive_due():
                await asyncio.to_thread(self.data_parallel.keepalive)
            if self.step_target and self.version >= self.step_target:
                self.running.clear()  # the last step's push and checkpoint are done by now
            if not self.running.is_set():
                self.paused_idle.set()
                await self.sync.publish_pending(self.version)  # a publication Redis missed
                await _wait_any(self.running, stop, timeout_s=1.0)
                continue
            self.paused_idle.clear()
            await self.intake(await self.consumer.take(stop, self.config.read_count))
            self.ready += self.assembler.pop_ready(self.version)
            await self.sync.reconcile(self.data_parallel.weights, self.version)
            if sum(g.counts for g in self.ready) < self.config.groups_per_step:
                continue
            groups = self.take_groups()
            await self.train(groups)
            await self.sync.push(self.data_parallel.weights, self.version)
            if self.version % self.config.checkpoint_interval_steps == 0:
                await self.checkpoint()
        if self.version > self.acks.checkpointed_step:
            await self.checkpoint()
        await asyncio.to_thread(self.data_parallel.stop)
        self.tracker.close()

    async def drain(self, grace_s: float) -> bool:
        """Wait (after `stop` was set) until `run` has finished the step in progress, its weight
        push and the last checkpoint: at most `grace_s` + FINAL_CHECKPOINT_S seconds. Returns
        False when it has not; the caller then cancels `run`, and the entries the unfinished
        steps resolved stay pending (re-read and trained again after a restart, never lost)."""
        task = self._run_task
        if task is None or task.done():
            return True
        done, _ = await asyncio.wait({task}, timeout=grace_s + FINAL_CHECKPOINT_S)
        if not done:
            log.warning(
                "learner loop busy past the grace period; step in progress abandoned",
                extra={
                    "grace_s": grace_s,
                    "policy_version": self.version,
                    "checkpointed_step": self.acks.checkpointed_step,
                },
            )
        return bool(done)

    async def close_streams(self) -> None:
        """After `run` ended: cancel a sharded consumer's reads in flight (what they delivered
        stays pending on its shard) and close the stream shards' clients."""
        if isinstance(self.consumer, ShardedStreamConsumer):
            await self.consumer.close()
        if self.shards is not None:
            await self.shards.aclose()

    # ----- stages ------------------------------------------------------------------------------------

    async def resume(self) -> None:
        """Load the latest checkpoint (if any) on every rank, then push its weights and publish
        its version. After a restart (a checkpoint found) the engines' stale weight-update
        sessions are ended first (`WeightSync.end_stale_sessions`)."""
        path = self.store.latest()
        if path is not None:
            state = await asyncio.to_thread(self.data_parallel.load, path)
            self.acks.restore(state.consumed_ids, state.step)
            self.assembler.restore_released(state.released_group_ids)
            self.resumed_step = state.step
            self.store.append_ledger(
                {"event": "resume", "step": state.step, "checkpoint": path.name}
            )
            log.info(
                "resumed from checkpoint",
                extra={"path": str(path), "step": state.step, "lr": self.trainer.lr},
            )
            # a restart: a killed predecessor may have left an engine's session open mid-push
            await self.sync.end_stale_sessions()
        metrics.POLICY_VERSION.set(self.version)
        metrics.LEARNER_STEP.set(self.version)
        self.completed_step = self.version
        await self.sync.push(self.data_parallel.weights, self.version)
        self.resumed.set()

    async def intake(self, entries: list[StreamEntry]) -> None:
        """Parse entries; skip consumed trajectory ids; hand the rest to the assembler."""
        for entry in entries:
            try:
                traj = parse_trajectory(entry.pb)
            except ContractError as exc:
                await self.consumer.dead_letter(entry, f"undecodable trajectory: {exc}")
                metrics.DROPPED.labels("invalid").inc()
                continue
            resolved_by = self.acks.resolved_by(traj.trajectory_id)
            if resolved_by is not None:  # trained or dropped already: never twice
                metrics.DROPPED.labels("duplicate").inc()
                if resolved_by <= self.acks.checkpointed_step:
                    await self.consumer.ack(entry.entry_id)  # a checkpoint already covers it
                else:
                    self.acks.wait_for_checkpoint(entry.entry_id)
                continue
            dropped = self.assembler.add(entry.entry_id, traj, self.version)
            if dropped is not None:
                self.resolve_dropped([dropped])

    def take_groups(self) -> list[RolloutGroup]:
        """The oldest `groups_per_step` counted groups, plus every uncounted group released before them."""
        taken, counted = [], 0
        while self.ready and counted < self.config.groups_per_step:
            group = self.ready.pop(0)
            taken.append(group)
            counted += group.counts
        return taken

    async def train(self, groups: list[RolloutGroup]) -> None:
        """Advantages, batch, one Trainer step (or a no-update step), metrics and the ledger."""
        start, version = time.perf_counter(), self.version
        samples, rewards, outcomes = [], [], []
        for g in groups:
            g = self.assembler.recheck(g, version)  # staleness at training time (C18)
            self.resolve_dropped(g.dropped)
            if not g.trainable:
                outcomes.append("dropped" if g.counts else "not_counted")
                continue
            gs = group_samples(g, self.config.fixed_temperature, self.config.overlong_filtering)
            rewards += [(m.trajectory.training_reward, m.trajectory.reward) for m in g.members]
            if gs.zero_variance and not self.config.train_zero_variance_groups:
                outcomes.append("zero_variance")
                self.resolve_members(g, trained=False)
                continue
            outcomes.append("trained")
            samples += gs.samples
            self.resolve_members(g, trained=True)
        for outcome in outcomes:
            metrics.GROUPS.labels(outcome).inc()
        result = None
        if self.config.fault_oom_at_step == version + 1 and self.resumed_step is None:
            # a fresh learner only: one restarted from a checkpoint (a restart policy) must not
            # die of the drill again
            await asyncio.to_thread(allocate_past_device_memory, self.trainer.params[0].device)
        if samples:
            result = await asyncio.to_thread(self.data_parallel.step, samples, version)
        else:
            await asyncio.to_thread(self.data_parallel.skip_step)
        self.record(
            version, groups, samples, rewards, outcomes, result, time.perf_counter() - start
        )

    def resolve_members(self, group: RolloutGroup, trained: bool) -> None:
        now = time.time()
        for m in group.members:
            self.acks.resolve(m.trajectory_id, m.entry_id, self.version + 1)
            if trained:
                self._staleness.append(max(0, self.version - m.min_policy_version))
                metrics.STALENESS.observe(self._staleness[-1])
                if m.trajectory.finished_at:
                    metrics.AGE.observe(max(0.0, now - m.trajectory.finished_at))

    def resolve_dropped(self, dropped: tuple[Dropped, ...] | list[Dropped]) -> None:
        for d in dropped:
            metrics.DROPPED.labels(d.reason).inc()
            if d.reason == "duplicate":
                self.acks.wait_for_checkpoint(d.entry_id)
            else:
                self.acks.resolve(d.trajectory_id, d.entry_id, self.version + 1)

    async def checkpoint(self) -> str:
        """Write a checkpoint of the current step, then acknowledge what it covers."""
        start, step = time.perf_counter(), self.version
        waiting = {
            g.group_id for g in self.ready
        }  # released but not trained yet: re-assembled after a crash
        state = LearnerState(
            step=step,
            version=step,
            consumed_ids=list(self.acks.consumed),
            released_group_ids=[g for g in self.assembler.released_group_ids() if g not in waiting],
        )
        path = await asyncio.to_thread(self.data_parallel.save, state)
        acked = self.acks.take_unacked()
        for lo in range(0, len(acked), 1000):
            await self.consumer.ack(*acked[lo : lo + 1000])
        self.acks.checkpointed_step = step
        metrics.CHECKPOINT_SECONDS.observe(time.perf_counter() - start)
        log.info(
            "checkpoint written; entries acknowledged",
            extra={"step": step, "path": str(path), "acked": len(acked)},
        )
        return str(path)

    # ----- control (HTTP) ----------------------------------------------------------------------------

    def resume_training(self, until_version: int | None = None) -> None:
        """Take steps until the policy version reaches `until_version`, then pause after that
        step's push (None: SHELLRL_MAX_STEPS; 0: no limit; a version past it pauses at once)."""
        self.step_target = self.config.max_steps if until_version is None else until_version
        self.running.set()

    def request_checkpoint(self) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._checkpoint_requests.append(future)
        return future

    async def serve_checkpoint_requests(self) -> None:
        if not self._checkpoint_requests:
            return
        requests, self._checkpoint_requests = self._checkpoint_requests, []
        try:
            path = await self.checkpoint()
            for f in requests:
                f.done() or f.set_result({"step": self.version, "path": path})
        except Exception as exc:  # noqa: BLE001 (handed to the HTTP callers, who report it)
            for f in requests:
                f.done() or f.set_exception(exc)

    def status(self) -> dict:
        return {
            "version": self.completed_step,
            "step": self.completed_step,
            "paused": not self.running.is_set(),
            "step_target": self.step_target,
            "world_size": self.trainer.ranks.world_size,
            "lr": self.trainer.lr,
            "checkpointed_step": self.acks.checkpointed_step,
            "pending_groups": self.assembler.pending_groups,
            "pending_trajectories": self.assembler.pending_trajectories,
            "ready_groups": len(self.ready),
            "unacked_entries": len(self.acks.unacked),
            "trajectories_trained": self.trained_total,
            "trajectories_per_second": self.trained_total
            / max(time.monotonic() - self.started_s, 1e-9),
            "last_step": self.last,
            "weight_sync": self.sync.status(),
        }

    # ----- bookkeeping ------------------------------------------------------------------------------

    def record(self, version, groups, samples, rewards, outcomes, result, seconds) -> None:
        """The step's record (step_metrics.step_record) to /v1/status, the tracker, the sample
        table when due, the ledger (steps.jsonl) and the log."""
        step = self.version
        self.trained_total += len(samples)
        self.last = step_record(
            step, version, groups, samples, rewards, outcomes, result, seconds, self._staleness
        )
        self._staleness = []
        self.tracker.log_metrics(flatten(self.last, exclude=("step", "finished_at")), step)
        if self.samples is not None and self.samples.due(step):
            if rows := self.samples.table(groups):
                self.tracker.log_table("samples", COLUMNS, rows, step)
        self.store.append_ledger(
            {
                "step": step,
                "version": step,
                "trajectory_ids": [s.trajectory_id for s in samples],
                **{k: v for k, v in self.last.items() if k not in ("stats", "step")},
            }
        )
        log.info(
            "step",
            extra={"policy_version": step, **{k: v for k, v in self.last.items() if k != "stats"}},
        )
        self.completed_step = step


def allocate_past_device_memory(device: torch.device) -> None:
    """Fault drill (`SHELLRL_FAULT_OOM_AT_STEP`): ask `device`'s allocator for more bytes than
    the device has (2x a GPU's total memory; 2**62 bytes on the host, past any address space, so
    no overcommit setting lets it through). Raises the allocator's own error:
    torch.OutOfMemoryError ("CUDA out of memory") on CUDA, RuntimeError ("DefaultCPUAllocator:
    can't allocate memory") on CPU."""
    if device.type == "cuda":
        nbytes = 2 * torch.cuda.get_device_properties(device).total_memory
    else:
        nbytes = 1 << 62
    torch.empty(nbytes, dtype=torch.uint8, device=device)


async def _wait_any(a: asyncio.Event, b: asyncio.Event, timeout_s: float) -> None:
    waits = [asyncio.ensure_future(a.wait()), asyncio.ensure_future(b.wait())]
    await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    await cancel_and_wait(*waits)
