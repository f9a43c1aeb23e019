"""The rollout stage: admit GRPO groups, run their episodes, hand trajectories to the verifier.

    pool (shellrl:tasks -> group "rollout")            task_pool.TaskPool
      -> capacity: G free episode slots                Capacity
      -> backpressure: verifier backlog < bound        StreamProducer.wait_for_backlog_below
      -> engine and sandbox answer their health probe  InfraGate
      -> sandbox health score >= threshold (else slow) HealthGate
      -> staleness bound on groups admitted            admission.Admission
      -> G episodes of one task, same sampling         agent_loop.AgentLoop
      -> XADD each trajectory to shellrl:episodes      (idempotent by trajectory_id)

A sample whose episode fails with an INFRA class is published (nothing is lost or hidden) and
re-run with `attempt + 1` (trajectory id `<group_id>-<index>-a<attempt>`: the lineage is the id
without its `-a<attempt>` suffix) up to `max_attempts`. INFRA is `shellrl.contract.is_infra`, the
learner's rule. A group left with fewer than 2 usable trajectories gives its admission back (and
so does one that the verifier's INFRA failures leave below 2 later: admission.py, stats.py).
SIGTERM (`stop`): stop admitting; `drain` lets running episodes finish within the grace period,
then cancels the rest (their sessions are deleted, their groups given back, their tasks put back
at the head of the epoch order). A task taken from the pool stays in this replica's taken list
until its group was handed off; after a kill, `run` puts those back first (task_pool.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    wait_exponential,
    wait_fixed,
)

from services.rollout import metrics as m
from services.rollout.admission import Admission, Ticket
from services.rollout.agent_loop import AgentLoop, is_setup_failure
from services.rollout.episode_spec import DEFAULT_SAMPLING, EpisodeSpec, Sampling
from services.rollout.gates import Capacity, GroupSlots, InfraGate
from services.rollout.health_gate import HealthGate
from services.rollout.seeding import episode_seed
from services.rollout.task_pool import TaskPool
from services.rollout.task_store import TaskStore
from shellrl.contract import (
    Failure,
    Task,
    Trajectory,
    failure_label,
    is_infra,
    min_policy_version,
)
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import GROUP_VERIFIER, STREAM_EPISODES, StreamShards

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 8
    sampling: Sampling = DEFAULT_SAMPLING
    max_attempts: int = 3
    retry_backoff_s: float = 1.0
    episodes_backlog_bound: int = 512
    episodes_stream_maxlen: int | None = None
    sampling_seed: int | None = None  # None: unseeded engine sampling (seeding.py)


class RolloutWorker:
    def __init__(
        self,
        redis: aioredis.Redis,
        store: TaskStore,
        pool: TaskPool,
        admission: Admission,
        agent: AgentLoop,
        capacity: Capacity,
        gate: InfraGate,
        config: RolloutConfig,
        health: HealthGate | None = None,
        shards: StreamShards | None = None,
    ) -> None:
        self.redis, self.store, self.pool, self.admission = redis, store, pool, admission
        self.agent, self.capacity, self.gate, self.config = agent, capacity, gate, config
        self.health = health
        # shellrl:episodes on the group's stream shard (shards.py; None: all on `redis`)
        self.producer = (shards or StreamShards(redis)).producer(
            STREAM_EPISODES, maxlen=config.episodes_stream_maxlen
        )
        self._groups: set[asyncio.Task] = set()
        self.published = 0
        self.running = (
            0  # episodes running now (slots taken for groups still waiting on admission excluded)
        )
        self.started_at = time.time()

    # --- the main loop: one screen ---------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Admit and start groups until `stop` is set; Redis errors are retried every second
        (tenacity) until then. Groups already started are `drain`'s."""
        recovered = False
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(RedisError),
                wait=wait_fixed(1.0),
                stop=lambda _: stop.is_set(),
                before_sleep=_redis_down,
                reraise=True,
            ):
                with attempt:
                    if not recovered:  # once: work in flight before a restart of this replica
                        await self.pool.recover()
                        await self.admission.recover()
                        recovered = True
                    await self._admit_groups(stop)
        except RedisError:  # only once `stop` is set: tenacity retries every other one
            pass

    async def _admit_groups(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            pooled = await self.pool.next_task()
            try:
                await self._wait("capacity", self.capacity.acquire(self.config.group_size))
            except BaseException:
                await _durable(lambda: self.pool.put_back(pooled.task.task_id))
                raise
            try:
                await self._wait(
                    "backlog",
                    self.producer.wait_for_backlog_below(
                        GROUP_VERIFIER, self.config.episodes_backlog_bound
                    ),
                )
                await self.gate.wait_up()
                if self.health is not None:
                    await self.health.wait()
                ticket = await self.admission.admit(new_group_id())
            except BaseException:
                await self.capacity.release(self.config.group_size)
                await _durable(lambda: self.pool.put_back(pooled.task.task_id))
                raise
            group = asyncio.create_task(self._run_taken(pooled.task, ticket, pooled.epoch))
            self._groups.add(group)
            group.add_done_callback(self._groups.discard)

    async def _run_taken(self, task: Task, ticket: Ticket, epoch: int) -> None:
        """`run_group` for a task taken from the pool: the pool forgets the task once its group
        was handed off (or failed); a cancelled group's task goes back to the epoch order."""
        try:
            await self.run_group(task, ticket, epoch=epoch)
        except asyncio.CancelledError:
            await _durable(lambda: self.pool.put_back(task.task_id))
            raise
        except Exception:
            await _durable(lambda: self.pool.done(task.task_id))
            raise
        await _durable(lambda: self.pool.done(task.task_id))

    async def run_group(self, task: Task, ticket: Ticket, *, epoch: int = 0) -> list[Trajectory]:
        """G samples of `task` (its run of epoch `epoch`: part of the samples' seeds); gives the
        admission back when fewer than 2 are usable.
        Owns the G capacity slots the main loop took: each sample frees its own as it ends, and
        whatever a cancellation left (samples that never started) is freed here."""
        slots = GroupSlots(self.capacity, self.config.group_size)
        results: list[Trajectory | None] = []
        # the task's episode counters, written by group commit beside the samples (TaskStore):
        # no sample waits for them, the group's hand-off does
        counters = [_counting(self.store.episodes_admitted(task.task_id, self.config.group_size))]
        begun: list[int] = []

        async def sample(i: int) -> Trajectory | None:
            begun.append(i)
            return await self.run_sample(task, ticket, i, slots, epoch, counters)

        try:
            results = list(
                await asyncio.gather(*(sample(i) for i in range(self.config.group_size)))
            )
        finally:
            await _shielded(slots.release_rest())
            if len(begun) < self.config.group_size:  # cancelled before some samples began
                unstarted = self.config.group_size - len(begun)
                counters.append(_counting(self.store.episodes_abandoned(task.task_id, unstarted)))
            await _shielded(_counted(counters))
            usable = usable_members(results)
            await _durable(lambda: self.admission.finish(ticket, usable=usable))
        return [t for t in results if t is not None]

    async def run_sample(
        self,
        task: Task,
        ticket: Ticket,
        index: int,
        slots: GroupSlots,
        epoch: int = 0,
        counters: list[asyncio.Future] | None = None,
    ) -> Trajectory | None:
        """One sample of a group, retried with attempt+1 on INFRA failures. Holds one capacity slot.
        counters: where its task-counter writes go, for the caller to await (None: awaited here)."""
        traj = None
        self.running += 1
        m.EPISODES_IN_FLIGHT.set(self.running)
        try:
            for attempt in range(self.config.max_attempts):
                if attempt:
                    m.RETRIES.inc()
                    await asyncio.sleep(self.config.retry_backoff_s * 2 ** (attempt - 1))
                    await self.gate.wait_up()
                spec = EpisodeSpec(
                    task=task,
                    trajectory_id=f"{ticket.group_id}-{index}-a{attempt}",
                    group_id=ticket.group_id,
                    group_size=self.config.group_size,
                    attempt=attempt,
                    sampling=self.config.sampling,
                    admitted_at=ticket.admitted_at,
                    seed=None
                    if self.config.sampling_seed is None
                    else episode_seed(self.config.sampling_seed, task.task_id, epoch, index),
                )
                traj = await self.agent.run(spec)
                final = (
                    not is_infra(traj.failure)
                    or is_setup_failure(traj)
                    or attempt + 1 == self.config.max_attempts
                )
                await self.publish(traj)
                counted = _counting(
                    self.store.episode_finished(
                        task.task_id,
                        failure=failure_label(traj.failure) if traj.failure else None,
                        policy_version=min_policy_version(traj),
                        final=final,
                    )
                )
                if counters is None:
                    await _counted([counted])
                else:
                    counters.append(counted)
                if traj.failure == Failure.FAILURE_INFRA_ENGINE:
                    self.gate.mark_down("engine")
                elif traj.failure == Failure.FAILURE_INFRA_SANDBOX and not is_setup_failure(traj):
                    self.gate.mark_down("sandbox")
                if final:
                    return traj
            return traj
        except asyncio.CancelledError:
            await _shielded(self.store.episodes_abandoned(task.task_id, 1))
            raise
        finally:
            self.running -= 1
            m.EPISODES_IN_FLIGHT.set(self.running)
            await _shielded(slots.release_one())

    async def publish(self, traj: Trajectory) -> None:
        """XADD to shellrl:episodes, idempotent by trajectory_id; retries while Redis is away
        (`StreamProducer.add_retrying`)."""
        version = min_policy_version(traj)
        await self.producer.add_retrying(
            traj.SerializeToString(),
            idempotency_key=traj.trajectory_id,
            task_id=traj.task_id,
            group_id=traj.group_id,
            version=-1 if version is None else version,
        )
        self.published += 1

    # --- shutdown ------------------------------------------------------------------------------

    async def drain(self, grace_s: float) -> None:
        """Let running groups finish for `grace_s`, then cancel the rest."""
        if self._groups:
            _, pending = await asyncio.wait(set(self._groups), timeout=grace_s)
            await cancel_and_wait(*pending)

    async def _wait(self, reason: str, awaitable) -> None:
        start = time.monotonic()
        await awaitable
        waited = time.monotonic() - start
        if waited > 0.001:
            m.ADMISSION_WAIT_SECONDS.labels(reason).observe(waited)


def usable_members(trajectories: list[Trajectory | None]) -> int:
    """Members that count toward a learner step: finished (not None) and not INFRA
    (`shellrl.contract.is_infra`; the learner's GroupAssembler counts the same way)."""
    return sum(1 for t in trajectories if t is not None and not is_infra(t.failure))


def new_group_id() -> str:
    return f"g-{uuid.uuid4().hex[:16]}"


def _redis_down(state: RetryCallState) -> None:
    log.warning(
        "rollout worker: Redis unavailable (%s); retrying in 1 s", state.outcome.exception()
    )


async def _shielded(awaitable) -> None:
    """Bookkeeping that must run even while the caller is being cancelled."""
    try:
        await asyncio.shield(asyncio.ensure_future(awaitable))
    except asyncio.CancelledError:
        pass
    except Exception as exc:  # bookkeeping is best effort: its failure is logged
        log.warning("bookkeeping failed: %s", exc)


_BOOKKEEPING: set[asyncio.Future] = set()


def _counting(write: Awaitable) -> asyncio.Future:
    """A task-counter write (TaskStore, by group commit) started on its own: a cancel of the
    sample that started it does not withdraw it."""
    return asyncio.ensure_future(write)


async def _counted(writes: list[asyncio.Future]) -> None:
    """Wait for counter writes; their failures are logged (statistics are best effort)."""
    for outcome in await asyncio.gather(*writes, return_exceptions=True):
        if isinstance(outcome, Exception):
            log.warning("bookkeeping failed: %s", outcome)


async def _durable(call: Callable[[], Awaitable]) -> None:
    """`_shielded` for bookkeeping that must reach Redis: the admission of a finished group, the
    taken list of the task pool. `call()` is retried on Redis errors (0.2 s doubling to 5 s,
    tenacity) until it succeeds, also after the caller was cancelled; a Redis restart during a
    group's hand-off used to leave the group in flight for good, and with strict admission the
    bound stops at its version: no group admitted again (found by tests/e2e/test_chaos.py). Each
    call is idempotent (a retry after a lost reply changes nothing). A caller that is being
    cancelled does not wait for it (the retries go on in the background), so a drain or a kill
    is not held up by a Redis outage."""

    async def until_done() -> None:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type((RedisError, OSError)),
            wait=wait_exponential(multiplier=0.2, max=5.0),
            before_sleep=_bookkeeping_failed,
            reraise=True,
        ):
            with attempt:
                await call()

    task = asyncio.ensure_future(until_done())
    _BOOKKEEPING.add(task)  # a strong reference while it runs on its own
    task.add_done_callback(_bookkeeping_done)
    current = asyncio.current_task()
    if current is None or not current.cancelling():
        await _shielded(task)


def _bookkeeping_done(task: asyncio.Future) -> None:
    _BOOKKEEPING.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("bookkeeping failed: %s", task.exception())


def _bookkeeping_failed(state: RetryCallState) -> None:
    log.warning(
        "bookkeeping failed (%r); retrying in %.1f s",
        state.outcome.exception(),
        state.upcoming_sleep,
    )
