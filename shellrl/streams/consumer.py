"""The consumer side of the stream layer: read in a group, acknowledge, re-claim, dead letters.
Handling attempts, poison entries and dead letters are booked in deliveries.py.

Import it as `shellrl.streams.StreamConsumer`; the guarantees are listed in producer.py.
A worker's loop:

    consumer = StreamConsumer(redis, STREAM_EPISODES, GROUP_VERIFIER, "verifier-1")
    await consumer.ensure_group()
    while running:
        for entry in await consumer.read():          # own pending, re-claimed, then new entries
            try:
                result = handle(parse_trajectory(entry.pb))
            except ContractError as exc:
                await consumer.fail(entry, str(exc))  # retried, dead-lettered after max_deliveries
                continue
            await consumer.forward(entry, downstream, result, idempotency_key=trajectory_id)

Each worker also runs `export_stream_stats` (stats.py) as a background task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from shellrl.streams import consumer_groups
from shellrl.streams.connection import check_block_ms
from shellrl.streams.deliveries import DEAD_LETTERS_KEPT, DeliveryLedger
from shellrl.streams.entry import OutgoingEntry, StreamEntry, _s
from shellrl.streams.keys import STREAM_DEAD
from shellrl.streams.metrics import RECLAIMED
from shellrl.streams.producer import StreamProducer
from shellrl.streams.stats import stream_stats

log = logging.getLogger("shellrl.streams")

_REDIS_AWAY = (RedisConnectionError, RedisTimeoutError, ConnectionError)  # retried, unlike others
T = TypeVar("T")
RENEWALS_PER_CLAIM_IDLE = 4  # keep_renewed renews held entries this often per claim_min_idle_ms


class StreamConsumer:
    """Reads one stream as consumer `consumer` of group `group`.

    Order of `read()`: this consumer's own pending entries once at start (recovery after a
    restart with the same name), entries of idle consumers (XAUTOCLAIM, at most every
    `claim_interval_s`), then new entries (blocking up to `block_ms`).

    block_ms: blocking read time, ms (0 < block_ms < MAX_BLOCK_MS and below half the client's
    socket timeout; ValueError otherwise). count: entries per read (XREADGROUP COUNT).
    claim_min_idle_ms: an entry unacknowledged this long is re-claimed from its consumer. It
    must exceed the longest time a live consumer holds an entry without renewing it (the rule
    every service's setting follows): then only the entries of a dead consumer are re-claimed.
    A consumer whose handling can take long runs `keep_renewed` beside its loop, which bounds
    that time by claim_min_idle_ms / RENEWALS_PER_CLAIM_IDLE however long handling takes.
    max_deliveries: deliveries after which an entry that fails (or whose consumers keep
    crashing) goes to `shellrl:dead`.

    A delivery (`StreamEntry.deliveries`) is a handling attempt: an entry handed to the caller by
    `read()`, counted in `attempts_key` (Redis' own times_delivered also counts reads whose reply
    the client lost, so a run of client timeouts would push healthy entries into dead letters).
    Entries this consumer has handed out and not yet acknowledged, forwarded, failed or
    dead-lettered are never handed out twice by it (a re-read of its own pending list skips them).
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        stream: str,
        group: str,
        consumer: str,
        *,
        block_ms: int = 1000,
        count: int = 16,
        claim_min_idle_ms: int = 60_000,
        claim_interval_s: float = 5.0,
        max_deliveries: int = 5,
        dead_stream: str = STREAM_DEAD,
        dead_maxlen: int = DEAD_LETTERS_KEPT,
    ) -> None:
        check_block_ms(redis, block_ms)
        if count < 1 or max_deliveries < 1 or dead_maxlen < 1:
            raise ValueError(
                f"count, max_deliveries and dead_maxlen must be >= 1; got {count}, {max_deliveries}, "
                f"{dead_maxlen}"
            )
        self.redis, self.stream, self.group, self.consumer = redis, stream, group, consumer
        self.block_ms, self.count = block_ms, count
        self.claim_min_idle_ms, self.claim_interval_s = claim_min_idle_ms, claim_interval_s
        self._ledger = DeliveryLedger(
            redis,
            stream,
            group,
            max_deliveries=max_deliveries,
            dead_stream=dead_stream,
            dead_maxlen=dead_maxlen,
        )
        self._recovered = False
        self._last_claim = 0.0

    async def ensure_group(self, start_id: str = "0") -> None:
        """Create the group (and the stream) if missing; `start_id="0"` delivers existing entries."""
        try:
            await self.redis.xgroup_create(self.stream, self.group, id=start_id, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def consume(
        self, stop: asyncio.Event, handle: Callable[[StreamEntry], Awaitable[None]], what: str
    ) -> None:
        """A one-at-a-time worker's loop until `stop`: take entries and `handle` each (it
        acknowledges, forwards or dead-letters; it must be idempotent). An exception from `handle`
        fails the entry: it stays pending, is re-claimed, and goes to the dead letters after
        max_deliveries. Redis away (connection errors, timeouts: a restart) is no failure of the
        entry: `handle` is called again once Redis answers, so that Redis restarts never push a
        healthy entry into the dead letters. `what` names the worker in the failure reason."""
        while not stop.is_set():
            for entry in await self.take(stop):
                try:  # Redis away is no fault of the entry: retried, never counted as a failure
                    await _while_redis_away(
                        lambda e=entry: handle(e), f"{what} ({entry.entry_id})", stop
                    )
                except _REDIS_AWAY:
                    return  # stopping while Redis is away: the entry stays pending
                except Exception as exc:  # the handler's own failure: counted for this entry
                    with contextlib.suppress(RedisError, OSError):
                        await self.fail(entry, f"{what}: {exc!r}")

    async def consume_batches(
        self,
        stop: asyncio.Event,
        handle_batch: Callable[[list[StreamEntry]], Awaitable[None]],
        what: str,
        *,
        min_interval_s: float = 0.0,
    ) -> None:
        """`consume` for a handler that takes each read's entries at once, so that their
        bookkeeping costs one round trip (`shellrl.streams.script_batch`). `handle_batch`
        acknowledges, fails or dead-letters each entry itself and must be idempotent (Redis away
        retries the whole batch once it answers). An exception from it fails every entry of the
        batch (each stays pending, is re-claimed and retried, and goes to the dead letters after
        max_deliveries): a handler fails an entry of its own on purpose instead of raising, so
        that one bad entry never costs its neighbours a delivery.
        min_interval_s: after a batch, the next read starts no sooner than this long (seconds)
        after the last one did: entries that arrive meanwhile wait in the stream and come as one
        batch (up to `count`), at the price of that much latency at most."""
        await batch_loop(self, stop, handle_batch, what, min_interval_s)

    async def take(self, stop: asyncio.Event, count: int | None = None) -> list[StreamEntry]:
        """`read()` for a worker's loop: Redis errors and client-side timeouts (a batch the server
        delivered but the client lost stays in this consumer's pending list) are retried with
        exponential backoff (0.5 s doubling to 10 s, tenacity) until `stop` is set, then `[]`.
        After any failed read the next read starts with this consumer's own pending entries, so a
        lost batch is handled by the next successful read instead of waiting for a re-claim."""
        try:
            async for attempt in AsyncRetrying(
                retry=retry_if_exception_type((RedisError, OSError)),
                wait=wait_exponential(multiplier=0.5, max=10.0),
                stop=lambda _state: stop.is_set(),
                before_sleep=self._read_failed,
                reraise=True,
            ):
                with attempt:
                    return await self.read(count)
        except (RedisError, OSError):
            self._recovered = False
        return []

    def _read_failed(self, state: RetryCallState) -> None:
        self._recovered = False  # the lost batch, if any, is in our own pending list
        log.warning(
            f"reading {self.stream} failed; retrying in {state.upcoming_sleep:.1f} s",
            extra={
                "stream": self.stream,
                "group": self.group,
                "consumer": self.consumer,
                "error": repr(state.outcome.exception()),
                "attempt": state.attempt_number,
            },
        )

    async def read(
        self, count: int | None = None, block_ms: int | None = None
    ) -> list[StreamEntry]:
        """Next entries to handle (possibly empty after `block_ms`). Poison entries are dead-lettered here.

        block_ms: None = the consumer's `block_ms`; 0 = do not block. Raises ValueError for a
        block_ms the blocking-read rule forbids (see `check_block_ms`).
        """
        count = count or self.count
        if block_ms is None:
            block_ms = self.block_ms
        elif block_ms:
            check_block_ms(self.redis, block_ms)
        if not self._recovered:
            self._recovered = True
            own = await self._read_own_pending(count=10_000)
            if own:
                return own
        if time.monotonic() - self._last_claim >= self.claim_interval_s:
            self._last_claim = time.monotonic()
            claimed = await self.claim_idle(count)
            if claimed:
                return claimed
        resp = await self.redis.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms or None
        )
        return await self._ledger.hand_out(
            [(_s(eid), f) for _, entries in resp or [] for eid, f in entries]
        )

    async def _read_own_pending(self, count: int) -> list[StreamEntry]:
        resp = await self.redis.xreadgroup(
            self.group, self.consumer, {self.stream: "0"}, count=count
        )
        entries = [(_s(eid), f) for _, es in resp or [] for eid, f in es]
        deleted = [eid for eid, f in entries if not f]
        if deleted:  # trimmed while pending (cannot happen through trim_acknowledged): drop refs
            await self._ledger.lost(deleted, ack=True)
        return await self._ledger.hand_out([(eid, f) for eid, f in entries if f])

    async def claim_idle(self, count: int | None = None) -> list[StreamEntry]:
        """XAUTOCLAIM entries idle longer than `claim_min_idle_ms`, following the cursor to the end
        (known_pitfalls C30: a reclaimer that drops the cursor never sees entries past the first page)."""
        out: list[StreamEntry] = []
        cursor = "0-0"
        want = count or self.count
        while len(out) < want:
            resp = await self.redis.xautoclaim(
                self.stream,
                self.group,
                self.consumer,
                self.claim_min_idle_ms,
                start_id=cursor,
                count=want - len(out),
            )
            cursor, claimed = _s(resp[0]), resp[1]
            if len(resp) > 2 and resp[2]:  # Redis >= 7: ids trimmed away, already out of the PEL
                await self._ledger.lost([_s(eid) for eid in resp[2]], ack=False)
            live = [(_s(eid), f) for eid, f in claimed if f]
            out += await self._ledger.hand_out(live)
            if cursor == "0-0":
                break
        if out:
            RECLAIMED.labels(self.stream, self.group).inc(len(out))
            log.warning(
                "re-claimed idle entries",
                extra={"stream": self.stream, "group": self.group, "count": len(out)},
            )
        return out

    async def ack(self, *entry_ids: str) -> int:
        """XACK `entry_ids` (one round trip for any number). Returns how many were pending (0 for
        those a retry after a lost reply finds acknowledged already). While Redis is away
        (connection errors, timeouts) it retries, 0.2 s doubling to 5 s (tenacity), until it
        succeeds; cancel the caller to give up. Why: the effect of the entries is durable by now
        (a learner's checkpoint), and a Redis restart at this moment must not fail the worker."""
        if not entry_ids:
            return 0
        self._ledger.done(*entry_ids)

        async def ack_once() -> int:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.xack(self.stream, self.group, *entry_ids)
                pipe.hdel(self._ledger.error_key, *entry_ids)
                pipe.hdel(self._ledger.attempts_key, *entry_ids)
                acked, _, _ = await pipe.execute()
            return int(acked)

        return await _while_redis_away(ack_once, f"acknowledging on {self.stream}")

    async def fail(self, entry: StreamEntry, reason: str) -> None:
        """Handling `entry` failed: leave it pending for a retry (re-claimed after
        `claim_min_idle_ms`), or dead-letter it when it has had `max_deliveries` deliveries."""
        await self._ledger.fail(entry, reason)

    async def renew(self) -> int:
        """Reset the idle time of every entry this consumer holds (handed out by `read`, not yet
        acknowledged, forwarded, failed or dead-lettered) and still owns, so that no other
        consumer's `claim_idle` takes it; counts no delivery. Returns how many were renewed."""
        return await self._ledger.renew(self.consumer)

    async def keep_renewed(self) -> None:
        """Run until cancelled: `renew` every claim_min_idle_ms / RENEWALS_PER_CLAIM_IDLE. A Redis
        error is logged and the next round tries again (a live consumer whose renewals fail for
        most of claim_min_idle_ms may see an entry re-claimed: handled twice, never lost)."""
        interval_s = self.claim_min_idle_ms / 1000 / RENEWALS_PER_CLAIM_IDLE
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.renew()
            except (RedisError, OSError) as exc:
                log.warning(
                    "renewing held entries failed",
                    extra={"stream": self.stream, "group": self.group, "error": repr(exc)},
                )

    async def dead_letter(self, entry: StreamEntry, reason: str) -> None:
        """Move `entry` to the dead-letter stream with `reason`, and acknowledge it (atomically).

        The dead entry keeps the original fields (`pb`, routing fields) and adds `source_stream`,
        `group`, `entry_id`, `reason`, `deliveries` (these win over original fields of that name).
        The dead-letter stream keeps the newest `dead_maxlen` entries (no group reads it, so trimming
        drops nothing undelivered; it is kept for inspection, and the counter keeps the total).
        """
        await self._ledger.dead_letter(entry, reason)

    async def forward(
        self, entry: StreamEntry, to: StreamProducer, pb: bytes, *, idempotency_key: str, **fields
    ) -> tuple[str, bool]:
        """Append `pb` to `to.stream` and acknowledge `entry`, atomically (one Lua script, one
        round trip; the script also drops the entry's delivery bookkeeping: attempts, last error).

        Returns (downstream entry_id, duplicate). A re-delivered entry whose result was already
        appended under `idempotency_key` is only acknowledged. While Redis is away it retries as
        `ack` does (the key makes a retry after a lost reply append nothing twice), so a Redis
        restart never fails a handled entry (a failure would count toward the dead letters).
        """
        self._ledger.done(entry.entry_id)

        async def forward_once() -> tuple[str, bool]:
            result = await to._add_one(
                OutgoingEntry(pb, idempotency_key, fields),
                ack=(self.stream, self.group, entry.entry_id),
                forget=(self._ledger.error_key, self._ledger.attempts_key),
            )
            await to._after_adds(1)
            return result

        return await _while_redis_away(forward_once, f"forwarding to {to.stream}")

    async def delete_idle_consumers(self, min_idle_ms: int) -> list[str]:
        """Remove consumers of this group idle >= `min_idle_ms` that hold no pending entries.

        A consumer with pending entries is never deleted (DELCONSUMER would drop its entries;
        known_pitfalls C30): re-claim them first. Returns the deleted consumer names.
        """
        return await consumer_groups.delete_idle_consumers(
            self.redis, self.stream, self.group, min_idle_ms
        )

    async def stats(self) -> dict[str, int]:
        """{"length", "pending", "lag"} of this stream/group; also sets the stream gauges."""
        return await stream_stats(self.redis, self.stream, self.group)


async def batch_loop(
    consumer,
    stop: asyncio.Event,
    handle_batch: Callable[[list[StreamEntry]], Awaitable[None]],
    what: str,
    min_interval_s: float = 0.0,
) -> None:
    """The loop of `StreamConsumer.consume_batches` for any consumer with `take` and `fail`
    (plain, or sharded: shards.py, whose `fail` routes a tagged entry to its shard)."""
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        started = loop.time()
        entries = await consumer.take(stop)
        if not entries:
            continue
        await _handle_batch(consumer, entries, handle_batch, what, stop)
        rest = started + min_interval_s - loop.time()
        if rest > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), rest)


async def _handle_batch(
    consumer,
    entries: list[StreamEntry],
    handle_batch: Callable[[list[StreamEntry]], Awaitable[None]],
    what: str,
    stop: asyncio.Event,
) -> None:
    try:  # Redis away is no fault of the entries: retried, never counted as a failure
        await _while_redis_away(
            lambda: handle_batch(entries), f"{what} ({len(entries)} entries)", stop
        )
    except _REDIS_AWAY:
        return  # stopping while Redis is away: the entries stay pending
    except Exception as exc:  # the handler's own failure: counted for each entry of the batch
        for entry in entries:
            with contextlib.suppress(RedisError, OSError):
                await consumer.fail(entry, f"{what}: {exc!r}")


async def _while_redis_away(
    call: Callable[[], Awaitable[T]], what: str, stop: asyncio.Event | None = None
) -> T:
    """`call()`, retried while Redis is away (`_REDIS_AWAY`: connection errors and timeouts, as
    in a restart) with backoff 0.2 s doubling to 5 s (tenacity), until it succeeds or `stop` is
    set (then its last error is raised). `call` must be idempotent: a retry may follow a call
    whose effect happened and whose reply was lost. Other errors are raised at once."""

    def failed(state: RetryCallState) -> None:
        log.warning(
            f"{what} failed, Redis away; retrying in {state.upcoming_sleep:.1f} s",
            extra={"error": repr(state.outcome.exception()), "attempt": state.attempt_number},
        )

    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type(_REDIS_AWAY),
        wait=wait_exponential(multiplier=0.2, max=5.0),
        stop=lambda _state: stop is not None and stop.is_set(),
        before_sleep=failed,
        reraise=True,
    ):
        with attempt:
            return await call()
    raise AssertionError("unreachable: tenacity either returns or re-raises")
