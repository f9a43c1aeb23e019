"""The producer side of the stream layer: append (idempotent, atomic), trim, backpressure.

The guarantees of the whole layer (see also consumer.py):
Delivery is at-least-once (DESIGN.md section 3). Guarantees of this module:
* `StreamProducer.add(..., idempotency_key=k)` appends at most one entry per key (one Lua script,
  one round trip; `add_retrying` retries it while Redis is away); `add_many` does the same for a
  batch in one MULTI/EXEC under WATCH (payloads
  stay out of Lua, whose copy of them is ~6x the command time of a large entry; for one entry
  the script's single round trip costs the server less CPU, see `_add_one`). Both are atomic,
  also in the AOF.
* `StreamConsumer.forward(entry, producer, ...)` appends the result downstream and acknowledges the
  input in the same script, so a crash can never leave "produced but not acknowledged" (and
  a re-delivery finds the idempotency key and only acknowledges). The same script drops the
  input's delivery bookkeeping (attempts, last error): one round trip a forward.
* Entries of crashed consumers are re-claimed with XAUTOCLAIM after `claim_min_idle_ms`; an entry
  delivered more than `max_deliveries` times goes to `shellrl:dead` with the reason and is acked
  (the newest 10,000 dead letters are kept).
* Trimming (`trim_acknowledged`, and `StreamProducer(maxlen=...)` which calls it every
  `trim_every` adds) never removes an entry some group has not acknowledged: MAXLEN is a memory
  bound on acknowledged history, not a way to shed load. Load is shed before XADD, by
  `wait_for_backlog_below` (backpressure).
* Blocking reads use `block_ms` well below the client's socket timeout (redis-py otherwise
  re-sends the blocking command and stalls; see ../shared/reference/ecosystem.md section 1.1):
  `StreamConsumer` refuses a `block_ms` at or above half the client's `socket_timeout`, and
  `read(block_ms=0)` never blocks (Redis' own BLOCK 0 would block forever).
* `delete_idle_consumers` removes only consumers without pending entries (XGROUP DELCONSUMER
  would throw their pending entries away; known_pitfalls C30).

Entries carry one field `pb` (serialized protobuf) plus small routing fields (`task_id`,
`group_id`, `version`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError, WatchError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from shellrl.streams import consumer_groups
from shellrl.streams.entry import OutgoingEntry, _flat_fields, _s
from shellrl.streams.keys import idempotency_key
from shellrl.streams.metrics import DUPLICATES

log = logging.getLogger("shellrl.streams")

_WATCH_ATTEMPTS = 20
_UNRECORDED = "?"  # value of an idempotency key between EXEC and the write of the entry id

# KEYS[1] stream, KEYS[2] idempotency key ("" = none), KEYS[3] stream to ack ("" = none),
# KEYS[4..] hashes whose field ARGV[3] goes with the ack (the delivery bookkeeping)
# ARGV[1] idempotency ttl s, ARGV[2] ack group, ARGV[3] ack id, ARGV[4..] field/value pairs
_ADD_SCRIPT = """
local existing = false
if KEYS[2] ~= '' then existing = redis.call('GET', KEYS[2]) end
local id
if existing then
  id = existing
else
  local args = {}
  for i = 4, #ARGV do args[#args + 1] = ARGV[i] end
  id = redis.call('XADD', KEYS[1], '*', unpack(args))
  if KEYS[2] ~= '' then redis.call('SET', KEYS[2], id, 'EX', tonumber(ARGV[1])) end
end
if KEYS[3] ~= '' then
  redis.call('XACK', KEYS[3], ARGV[2], ARGV[3])
  for i = 4, #KEYS do redis.call('HDEL', KEYS[i], ARGV[3]) end
end
if existing then return {id, 1} end
return {id, 0}
"""


IDEMPOTENCY_TTL_S = 3600
"""How long an idempotency key lives. It has to outlast a retried add after a lost reply and a
forward re-run after a crash (seconds to minutes; a Redis outage longer than this makes a late
retry append a duplicate, which consumers drop by trajectory_id). Not longer: each trajectory
leaves one key per stream (136 bytes), and the 7 days they were kept before held 3.8 GB of Redis
per engine at the GPU job's rate (issue 35, BENCHMARKS.md "The control plane at cluster scale")."""


class StreamProducer:
    """Appends entries to one stream.

    idempotency_ttl_s: how long an idempotency key is remembered (seconds).
    maxlen: when set, every `trim_every` adds call `trim_acknowledged(maxlen)` (None: never trim).
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        stream: str,
        *,
        idempotency_ttl_s: int = IDEMPOTENCY_TTL_S,
        maxlen: int | None = None,
        trim_every: int = 100,
    ) -> None:
        if maxlen is not None and maxlen < 0:
            raise ValueError(f"maxlen must be >= 0; got {maxlen}")
        if trim_every < 1:
            raise ValueError(f"trim_every must be >= 1; got {trim_every}")
        self.redis, self.stream, self.idempotency_ttl_s = redis, stream, idempotency_ttl_s
        self.maxlen, self.trim_every = maxlen, trim_every
        self._adds_since_trim = 0
        self._script = redis.register_script(_ADD_SCRIPT)

    async def add(
        self, pb: bytes, *, idempotency_key: str | None = None, **fields: str | int | bytes
    ) -> tuple[str, bool]:
        """XADD `pb` with routing `fields` in one round trip (a Lua script). Returns (entry_id, duplicate).

        With `idempotency_key`, a second add of the same key (within `idempotency_ttl_s`) appends
        nothing and returns the first entry's id with `duplicate=True` ("" when the first add came
        through `add_many` and has not recorded its id yet; the key still counts).
        """
        result = await self._add_one(OutgoingEntry(pb, idempotency_key, fields))
        await self._after_adds(1)
        return result

    async def add_retrying(
        self, pb: bytes, *, idempotency_key: str, **fields: str | int | bytes
    ) -> tuple[str, bool]:
        """`add`, retried while Redis is away (RedisError) with exponential backoff, 0.2 s doubling
        to 5 s (tenacity), until the entry is stored; cancel the caller to give up. The idempotency
        key is required: a retry after a lost reply must not append the entry twice."""
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(RedisError),
            wait=wait_exponential(multiplier=0.2, max=5.0),
            before_sleep=self._add_failed,
            reraise=True,
        ):
            with attempt:
                return await self.add(pb, idempotency_key=idempotency_key, **fields)
        raise AssertionError("unreachable: tenacity either returns or re-raises")

    def _add_failed(self, state: RetryCallState) -> None:
        log.warning(
            f"XADD to {self.stream} failed; retrying in {state.upcoming_sleep:.1f} s",
            extra={
                "stream": self.stream,
                "error": repr(state.outcome.exception()),
                "attempt": state.attempt_number,
            },
        )

    async def add_many(self, entries: Sequence[OutgoingEntry]) -> list[tuple[str, bool]]:
        """`add` for several entries in one transaction: all new entries of the batch are appended
        or none (MULTI/EXEC), each at most once per idempotency key. Returns [(entry_id, duplicate)]
        in order. The bulk path: payloads never pass through Lua (see `_add_entries`)."""
        if not entries:
            return []
        out = await self._add_entries(entries)
        await self._after_adds(len(entries))
        return out

    async def _add_one(
        self,
        e: OutgoingEntry,
        ack: tuple[str, str, str] | None = None,
        forget: Sequence[str] = (),
    ) -> tuple[str, bool]:
        """One entry (and optionally XACK `ack` = (stream, group, entry_id) and HDEL of that
        entry_id from each hash of `forget`) in one atomic script: one round trip.

        Why the payload still goes through Lua (which copies it in and out, unlike `add_many`'s
        MULTI/EXEC): on one Redis thread a round trip costs more than the copy. Measured in
        benchmarks/bench_stream_appends.py (BENCHMARKS.md, "The control plane at cluster scale"):
        at 4 KB this script cost the server 88 µs of CPU an append, the WATCH/MULTI form with the
        same guarantees (3 round trips) 99 µs (1.12-1.35x in three runs); at 34 KB 199 against
        169 µs. Each round trip costs the server 11-33 µs; Lua's copy ~22 µs at 4 KB.
        """
        if forget and ack is None:
            raise ValueError("forget needs ack: the hashes are cleared of the acknowledged id")
        key = idempotency_key(self.stream, e.idempotency_key) if e.idempotency_key else ""
        ack_stream, ack_group, ack_id = ack or ("", "", "")
        flat = [x for item in _flat_fields(e).items() for x in item]
        entry_id, dup = await self._script(
            keys=[self.stream, key, ack_stream, *forget],
            args=[self.idempotency_ttl_s, ack_group, ack_id, *flat],
        )
        if dup:
            DUPLICATES.labels(self.stream).inc()
        return _s(entry_id).removeprefix(_UNRECORDED), bool(dup)

    async def _add_entries(self, entries: Sequence[OutgoingEntry]) -> list[tuple[str, bool]]:
        """Append `entries` unless their idempotency key exists, in one MULTI/EXEC under WATCH of the
        keys (a concurrent add of the same key aborts the transaction, which is then re-run and
        sees the key).

        Why not the Lua script of `add`: Redis copies every script argument into Lua and back,
        which measured ~85 µs of server time per 34 KB trajectory versus ~15 µs for XADD + SET
        (INFO commandstats during benchmarks/bench_streams.py). Costs 3 round trips (4 with new
        keys: their entry ids are written after EXEC) per call, whatever the batch size; each
        round trip costs the server more CPU than that copy (`_add_one`), so this pays for
        batches, not for one entry.
        """
        keys = [
            idempotency_key(self.stream, e.idempotency_key) if e.idempotency_key else ""
            for e in entries
        ]
        watched = sorted({k for k in keys if k})
        for _ in range(_WATCH_ATTEMPTS):
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    existing: dict[str, bytes] = {}
                    if watched:
                        await pipe.watch(*watched)
                        existing = {
                            k: v for k, v in zip(watched, await pipe.mget(watched)) if v is not None
                        }
                    pipe.multi()
                    plan: list[
                        tuple[str, object]
                    ] = []  # ("dup", id) | ("new", key) | ("same", index)
                    first: dict[str, int] = {}
                    for i, (e, key) in enumerate(zip(entries, keys)):
                        if key in existing:
                            plan.append(("dup", _s(existing[key]).removeprefix(_UNRECORDED)))
                        elif key and key in first:
                            plan.append(("same", first[key]))
                        else:
                            pipe.xadd(self.stream, _flat_fields(e))
                            if key:
                                pipe.set(key, _UNRECORDED, ex=self.idempotency_ttl_s)
                                first[key] = i
                            plan.append(("new", key))
                    results = await pipe.execute() if len(pipe) else []
                except WatchError:
                    continue
            out: list[tuple[str, bool]] = []
            pos, recorded = 0, {}
            for kind, value in plan:
                if kind == "new":
                    entry_id = _s(results[pos])
                    pos += 2 if value else 1
                    if value:
                        recorded[value] = entry_id
                    out.append((entry_id, False))
                elif kind == "same":
                    out.append((out[value][0], True))
                else:
                    out.append((value, True))
            if (
                recorded
            ):  # best effort: a crash here leaves _UNRECORDED, which still marks the key used
                async with self.redis.pipeline(transaction=False) as pipe:
                    for key, entry_id in recorded.items():
                        pipe.set(key, entry_id, xx=True, keepttl=True)
                    await pipe.execute()
            dups = sum(dup for _, dup in out)
            if dups:
                DUPLICATES.labels(self.stream).inc(dups)
            return out
        raise RuntimeError(
            f"{self.stream}: idempotency keys kept changing during {_WATCH_ATTEMPTS} attempts"
        )

    async def _after_adds(self, n: int) -> None:
        if self.maxlen is None:
            return
        self._adds_since_trim += n
        if self._adds_since_trim >= self.trim_every:
            self._adds_since_trim = 0
            await self.trim_acknowledged(self.maxlen)

    async def backlog(self, group: str) -> int:
        """Entries of `stream` that `group` has not acknowledged: pending + not yet delivered."""
        return await consumer_groups.backlog(self.redis, self.stream, group)

    async def wait_for_backlog_below(
        self, group: str, bound: int, *, poll_s: float = 0.2, timeout_s: float | None = None
    ) -> float:
        """Backpressure: wait while `group`'s backlog is at or above `bound`. Returns seconds waited.

        Raises TimeoutError after `timeout_s` (None = wait forever).
        """
        return await wait_while_backlog(self, group, bound, poll_s=poll_s, timeout_s=timeout_s)

    async def trim_acknowledged(self, maxlen: int) -> int:
        """If XLEN > maxlen, drop entries that every group has delivered and acknowledged.

        Never removes an entry that is pending or undelivered in any group; a stream without
        groups is never trimmed. XTRIM MINID ~ trims whole radix-tree nodes only, so it may keep
        some acknowledged entries, never the reverse. Returns the number of entries removed.
        """
        return await consumer_groups.trim_acknowledged(self.redis, self.stream, maxlen)


async def wait_while_backlog(
    producer, group: str, bound: int, *, poll_s: float = 0.2, timeout_s: float | None = None
) -> float:
    """Poll `producer.backlog(group)` every `poll_s` s while it is >= `bound`; seconds waited.
    TimeoutError after `timeout_s` (None: forever). The loop of every producer's backpressure
    (StreamProducer, shards.ShardedStreamProducer)."""
    start = time.monotonic()
    while await producer.backlog(group) >= bound:
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise TimeoutError(
                f"{producer.stream}: backlog of group {group} stayed >= {bound} for {timeout_s}s"
            )
        await asyncio.sleep(poll_s)
    return time.monotonic() - start
