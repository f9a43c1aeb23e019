"""Stream stage of the verifier: `shellrl:episodes` (group `verifier`) → `shellrl:trajectories`.

For each trajectory: run its task's checks against its sandbox session, compute the reward,
release the session, then append the scored trajectory downstream and acknowledge the input in
one atomic step (`StreamConsumer.forward`, idempotent by `trajectory_id`). Guarantees:
* a crash anywhere before `forward` leaves the entry pending; it is re-claimed and handled
  again, and `forward`'s idempotency key means the learner-visible stream holds it once;
* a trajectory that already failed upstream (INFRA_ENGINE, INFRA_SANDBOX, TIMEOUT_BUDGET …)
  passes through unscored with its failure class (its session is still released);
* a verification that cannot complete passes through unscored as FAILURE_INFRA_VERIFIER;
* eval trajectories (`eval`) go to `shellrl:evaluations`, never to the training stream;
* an undecodable entry is retried (`consumer.fail`) and dead-lettered after `max_deliveries`;
* on stop no new verification starts (entries taken but not started stay pending); `drain`
  lets the running ones finish within the grace period and cancels the rest (left pending);
* an entry being verified is renewed (`StreamConsumer.keep_renewed`) until it is forwarded, so
  another replica re-claims it only once this one died, however long its checks run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from redis.exceptions import RedisError

from services.verifier import metrics
from services.verifier.verification import Verification, Verifier
from shellrl.clients.sandbox import SandboxNotFound
from shellrl.contract import (
    ContractError,
    EpisodeEnd,
    Failure,
    Trajectory,
    failure_label,
    parse_trajectory,
)
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import (
    ShardedStreamConsumer,
    ShardedStreamProducer,
    StreamConsumer,
    StreamEntry,
    StreamProducer,
    StreamShards,
    idempotency_key,
    producer_for_entry,
)

log = logging.getLogger(__name__)


def tool_events(traj: Trajectory) -> list:
    return [seg.tool_event for seg in traj.segments if seg.HasField("tool_event")]


def final_answer(traj: Trajectory) -> str | None:
    """The agent's final answer, or None when the episode ended without one (max turns, context)."""
    if traj.end == EpisodeEnd.EPISODE_END_ANSWER:
        return traj.answer
    if traj.end == EpisodeEnd.EPISODE_END_UNSPECIFIED and traj.answer:
        return traj.answer
    return None


class VerifierWorker:
    """Consumes episodes, verifies them `concurrency` at a time, forwards the results.

    sandbox: a SandboxClient (for releasing sessions). release_sessions: DELETE each episode's
    session after scoring. With stream shards (shellrl/streams/shards.py) `consumer` reads every
    shard and a result goes to `trajectories` on its episode's own shard; evaluations stay on
    shard 0.
    """

    def __init__(
        self,
        consumer: StreamConsumer | ShardedStreamConsumer,
        trajectories: StreamProducer | ShardedStreamProducer,
        evaluations: StreamProducer,
        verifier: Verifier,
        sandbox,
        *,
        concurrency: int,
        release_sessions: bool = True,
        shards: StreamShards | None = None,
    ) -> None:
        self.consumer, self.trajectories, self.evaluations = consumer, trajectories, evaluations
        self.shards = shards  # closed by `aclose` (the shard clients; shard 0 is the caller's)
        self.verifier, self.sandbox = verifier, sandbox
        self.concurrency, self.release_sessions = concurrency, release_sessions
        self._in_flight: set[asyncio.Task] = set()
        self._renewing: asyncio.Task | None = None  # keeps in-flight entries ours (until drained)

    async def run(self, stop: asyncio.Event) -> None:
        """Take work, verify `concurrency` at a time (each: verify, hand on, acknowledge, in
        `handle`); until `stop`. Redis outages are waited out by `StreamConsumer.take`."""
        await self.consumer.ensure_group()
        self._renewing = self._renewing or asyncio.create_task(self.consumer.keep_renewed())
        slots = asyncio.Semaphore(self.concurrency)
        while not stop.is_set():
            free = self.concurrency - len(self._in_flight)
            if free <= 0:
                await slots.acquire()  # wait for a slot, without busy-looping
                slots.release()
                continue
            for entry in await self.consumer.take(stop, free):
                await slots.acquire()
                if stop.is_set():  # stopping: the rest stay pending (re-read or re-claimed)
                    slots.release()
                    break
                task = asyncio.create_task(self.handle(entry))
                self._in_flight.add(task)
                task.add_done_callback(lambda t: (self._in_flight.discard(t), slots.release()))

    async def drain(self, grace_s: float) -> None:
        """Let running verifications finish for `grace_s` seconds, then cancel the rest: their
        entries stay pending in Redis (re-claimed by another replica or after a restart)."""
        if self._in_flight:
            done, pending = await asyncio.wait(set(self._in_flight), timeout=grace_s)
            await cancel_and_wait(*pending, timeout_s=5.0)
            log.info("worker drained", extra={"finished": len(done), "left_pending": len(pending)})
        await cancel_and_wait(self._renewing, timeout_s=5.0)

    async def aclose(self) -> None:
        """After `drain` and the end of `run`: cancel a sharded consumer's reads in flight and
        close the stream shards' clients."""
        if isinstance(self.consumer, ShardedStreamConsumer):
            await self.consumer.close()
        if self.shards is not None:
            await self.shards.aclose()

    async def handle(self, entry: StreamEntry) -> None:
        """Verify and forward one entry; failures leave it pending for a retry (never lost)."""
        try:
            traj = parse_trajectory(entry.pb)
        except ContractError as exc:
            metrics.TRAJECTORIES.labels("undecodable").inc()
            await self.consumer.fail(entry, f"undecodable trajectory: {exc}")
            return
        metrics.IN_FLIGHT.inc()
        out = self.evaluations if traj.eval else self.trajectories
        try:
            shard_out = producer_for_entry(out, entry.entry_id)  # on the entry's own Redis
            if entry.deliveries > 1 and await self.already_forwarded(shard_out, traj.trajectory_id):
                outcome = (
                    "duplicate"  # re-delivered after a crash past forward's XADD: only acknowledge
                )
            else:
                outcome = await self.score(traj)
            _, duplicate = await self.consumer.forward(
                entry,
                out,
                traj.SerializeToString(),
                idempotency_key=traj.trajectory_id,
                task_id=entry.text("task_id", traj.task_id),
                group_id=entry.text("group_id", traj.group_id),
                version=entry.text("version", ""),
            )
            metrics.TRAJECTORIES.labels("duplicate" if duplicate else outcome).inc()
            # only once the result is durable: a retry after a failed or crashed forward must
            # still find the session (released first, it scored as an INFRA failure)
            await self.release(traj)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure of one episode: it stays pending, is retried
            log.exception(
                "handling an episode failed; it stays pending",
                extra={"trajectory_id": traj.trajectory_id, "entry_id": entry.entry_id},
            )
            with contextlib.suppress(RedisError, OSError):  # Redis away: pending anyway
                await self.consumer.fail(entry, f"{type(exc).__name__}: {exc}")
        finally:
            metrics.IN_FLIGHT.dec()

    async def already_forwarded(self, out: StreamProducer, trajectory_id: str) -> bool:
        """Whether a result of `trajectory_id` was appended already (an optimisation: when Redis
        does not answer, False, and `forward`'s idempotency key keeps the stream to one)."""
        try:
            return bool(await out.redis.exists(idempotency_key(out.stream, trajectory_id)))
        except (RedisError, OSError):
            return False

    async def score(self, traj: Trajectory) -> str:
        """Verify `traj` in place. Returns the metrics outcome: scored / unscored / passed_through."""
        if traj.failure != Failure.FAILURE_NONE:
            Verification((), None, traj.failure, traj.failure_detail).apply_to(traj)
            return "passed_through"
        if not traj.HasField("task"):
            result = Verification(
                (), None, Failure.FAILURE_INFRA_VERIFIER, "the trajectory carries no task"
            )
        else:
            result = await self.verifier.verify(
                traj.task,
                final_answer(traj),
                traj.sandbox_session_id or None,
                tool_events(traj),
                trajectory_id=traj.trajectory_id,
            )
        result.apply_to(traj)
        log.info(
            "verified",
            extra={
                "trajectory_id": traj.trajectory_id,
                "group_id": traj.group_id,
                "task_id": traj.task_id,
                "reward": traj.reward,
                "scored": traj.scored,
                "failure": failure_label(traj.failure),
                "duration_ms": round(result.duration_ms, 1),
            },
        )
        return "scored" if result.scored else "unscored"

    async def release(self, traj: Trajectory) -> None:
        """DELETE the episode's sandbox session (gone already is fine; errors only counted:
        the sandbox's idle TTL removes what we could not)."""
        if not (self.release_sessions and traj.sandbox_session_id and self.sandbox is not None):
            return
        metrics.SESSION_RELEASES.labels(
            await release_session(self.sandbox, traj.sandbox_session_id)
        ).inc()


async def release_session(sandbox, session_id: str) -> str:
    """DELETE a sandbox session; returns "ok", "gone" or "error" (never raises)."""
    try:
        await sandbox.delete(session_id)
        return "ok"
    except SandboxNotFound:
        return "gone"
    except Exception as exc:  # noqa: BLE001 (never raises: the sandbox's TTL removes what we could not)
        log.warning(
            "releasing a sandbox session failed",
            extra={"session_id": session_id, "error": repr(exc)},
        )
        return "error"
