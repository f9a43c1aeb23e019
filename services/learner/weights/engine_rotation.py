"""What the learner knows about its engines and what it tells others: per-engine state (rotation,
confirmed version, the registered instance it pushed to, failures), the result of one push,
publishing a version to Redis (SET shellrl:policy:version + PUBLISH shellrl:policy:updates), the
`shellrl:engines:sync` hash the gateway routes by (shellrl.clients.engine_registry), and the
engine gauges."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import asdict, dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.learner import metrics
from shellrl.streams import POLICY_UPDATES_CHANNEL, POLICY_VERSION_KEY
from shellrl.streams.keys import ENGINE_SYNC_KEY

log = logging.getLogger("services.learner.weights.weight_sync")


@dataclass
class EngineState:
    """What the learner knows about one engine. version: the last weight_version it confirmed;
    instance: the registration instance (shellrl:engines) that version went to (None: a seed
    engine that never registered); last_ok_at: unix seconds of the last confirmation."""

    url: str
    in_rotation: bool = True
    version: str | None = None
    instance: str | None = None
    last_error: str | None = None
    last_ok_at: float | None = None
    failures: int = 0
    tp_size: int | None = None  # from /server_info on first contact (again after a failure)
    # shellrl's engine (/server_info version "shellrl-engine-..."): stages every bucket of a
    # session and swaps them in at its end, so no token is ever sampled on a mix
    commits_atomically: bool | None = None
    dtype: str | None = None  # what it serves in (weight_dtype.engine_dtype; None: unknown)
    # why the learner never pushes to it (weight_dtype.refusal: weights it cannot produce), from
    # its last /server_info; the gateway shows it (EngineSync.refused)
    refused: str | None = None
    info_read: bool = field(default=False, repr=False)  # /server_info read since (re)contact
    last_probe_s: float = field(default=0.0, repr=False)

    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("last_probe_s")
        out.pop("info_read")
        return out


@dataclass(frozen=True)
class SyncResult:
    """One push: which engines confirmed `version`, which failed (url -> reason), whether the
    version was published, whether only part of the configured fleet has it, phase seconds."""

    version: int
    confirmed: tuple[str, ...]
    failed: dict[str, str]
    published: bool
    partial: bool
    phases: dict[str, float]


async def bounded(coro, timeout_s: float):
    """Await `coro` for at most timeout_s; None on timeout or error (probes and clean-ups only)."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return None
    try:
        return task.result()
    except Exception:  # noqa: BLE001 (a probe or clean-up: any failure means "no answer")
        return None


async def publish_version(
    redis: aioredis.Redis | None, engines: dict[str, EngineState], version: int, partial: bool
) -> bool:
    """SET + PUBLISH `version` when every engine in rotation (at least one) confirmed it and
    there is a Redis; `partial` (engines were taken out on this push) is logged as a warning.
    False when it did not publish, also when Redis did not answer (never raises then: a Redis
    restart must not stop the learner; `WeightSync.reconcile` publishes it on the next loop)."""
    in_rotation = [u for u, e in engines.items() if e.in_rotation]
    if not in_rotation or redis is None:
        return False
    if not all(engines[u].version == str(version) for u in in_rotation):
        return False
    if partial:
        log.warning(
            "publishing the version for a partial fleet",
            extra={
                "policy_version": version,
                "in_sync": in_rotation,
                "out_of_rotation": [u for u, e in engines.items() if not e.in_rotation],
            },
        )
    try:
        async with redis.pipeline(transaction=True) as pipe:
            pipe.set(POLICY_VERSION_KEY, version)
            pipe.publish(POLICY_UPDATES_CHANNEL, str(version))
            await pipe.execute()
    except (RedisError, OSError) as exc:  # Redis restarting: WeightSync.reconcile publishes it
        log.warning(
            "could not publish the version; retried on the next loop",
            extra={"policy_version": version, "error": repr(exc)},
        )
        return False
    return True


def update_gauges(engines: dict[str, EngineState]) -> None:
    metrics.ENGINES_IN_SYNC.set(sum(e.in_rotation for e in engines.values()))
    metrics.ENGINES_OUT.set(sum(not e.in_rotation for e in engines.values()))


def take_out_of_rotation(state: EngineState, reason: str) -> None:
    """Mark `state` out of rotation so that `WeightSync.reconcile` probes it at once and brings it
    back with a full update (its confirmed version no longer holds)."""
    state.in_rotation, state.version, state.last_error = False, None, reason
    state.tp_size, state.commits_atomically, state.last_probe_s = None, None, 0.0
    state.info_read = False  # its /server_info is read again (a restart may serve another dtype)


async def write_engine_states(
    redis: aioredis.Redis | None, engines: dict[str, EngineState]
) -> None:
    """The `shellrl:engines:sync` hash (url -> JSON EngineState), which the gateway routes by; a
    failure is logged, never raised."""
    if redis is None or not engines:
        return
    try:
        await redis.hset(
            ENGINE_SYNC_KEY, mapping={u: json.dumps(e.to_json()) for u, e in engines.items()}
        )
    except Exception:  # status only: never fail a push over it
        log.exception("could not write shellrl:engines:sync")
