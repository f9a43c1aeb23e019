"""Every Redis-stream rule of shellrl: names, produce, consume, acknowledge, re-claim, dead letters.

Delivery is at-least-once (DESIGN.md section 3). Guarantees of this module:
* `StreamProducer.add(..., idempotency_key=k)` / `add_many` append at most one entry per key
  (WATCH + MULTI/EXEC: the XADD and the key's SET are one transaction, also in the AOF).
* `StreamConsumer.forward(entry, producer, ...)` appends the result downstream and acknowledges the
  input in the same transaction, so a crash can never leave "produced but not acknowledged" (and
  a re-delivery finds the idempotency key and only acknowledges).
* Entries of crashed consumers are re-claimed with XAUTOCLAIM after `claim_min_idle_ms`; an entry
  delivered more than `max_deliveries` times goes to `shellrl:dead` with the reason and is acked.
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import ResponseError, WatchError

from shellrl import metrics

log = logging.getLogger(__name__)

STREAM_TASKS = "shellrl:tasks"
STREAM_EPISODES = "shellrl:episodes"
STREAM_TRAJECTORIES = "shellrl:trajectories"
STREAM_DEAD = "shellrl:dead"
POLICY_VERSION_KEY = "shellrl:policy:version"
POLICY_UPDATES_CHANNEL = "shellrl:policy:updates"
GROUP_ROLLOUT, GROUP_VERIFIER, GROUP_LEARNER = "rollout", "verifier", "learner"

_WATCH_ATTEMPTS = 20
_UNRECORDED = "?"  # value of an idempotency key between EXEC and the write of the entry id
SOCKET_TIMEOUT_S = 30.0
MAX_BLOCK_MS = 5_000  # keep blocking reads far below SOCKET_TIMEOUT_S


def task_key(task_id: str) -> str:
    return f"shellrl:task:{task_id}"


def idempotency_key(stream: str, key: str) -> str:
    return f"shellrl:idem:{stream}:{key}"


STREAM_LENGTH = metrics.gauge("shellrl_stream_length", "Entries in a stream (XLEN).", ("stream",))
STREAM_PENDING = metrics.gauge(
    "shellrl_stream_pending", "Entries delivered to a group but not acknowledged.", ("stream", "group")
)
STREAM_LAG = metrics.gauge("shellrl_stream_lag", "Entries not yet delivered to a group.", ("stream", "group"))
RECLAIMED = metrics.counter(
    "shellrl_stream_reclaimed_total", "Entries re-claimed from idle consumers.", ("stream", "group")
)
DEAD_LETTERS = metrics.counter(
    "shellrl_stream_dead_letters_total", "Entries moved to shellrl:dead.", ("stream", "group")
)
DUPLICATES = metrics.counter(
    "shellrl_stream_duplicates_total", "Adds skipped because their idempotency key existed.", ("stream",)
)
TRIMMED = metrics.counter(
    "shellrl_stream_trimmed_total", "Acknowledged entries removed by trimming.", ("stream",)
)


def connect(url: str, **kwargs) -> aioredis.Redis:
    """An asyncio Redis client for binary payloads, with a socket timeout above every block_ms."""
    kwargs.setdefault("socket_timeout", SOCKET_TIMEOUT_S)
    kwargs.setdefault("health_check_interval", 15)
    return aioredis.Redis.from_url(url, decode_responses=False, **kwargs)


def check_block_ms(redis: aioredis.Redis, block_ms: int) -> None:
    """Raise ValueError unless 0 < block_ms < MAX_BLOCK_MS and block_ms < half the client's
    socket_timeout (ms). redis-py retries a blocking read that hits its socket timeout, which
    re-sends XREADGROUP and stalls the consumer (redis/redis-py#2807, #3138)."""
    if not 0 < block_ms < MAX_BLOCK_MS:
        raise ValueError(f"block_ms must be in (0, {MAX_BLOCK_MS}); got {block_ms}")
    socket_timeout_s = redis.connection_pool.connection_kwargs.get("socket_timeout")
    if socket_timeout_s is not None and block_ms >= 500 * socket_timeout_s:
        raise ValueError(
            f"block_ms={block_ms} must stay below half the client's socket_timeout ({socket_timeout_s}s); "
            "use shellrl.streams.connect() or a larger socket_timeout"
        )


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _next_id(entry_id: str) -> str:
    ms, seq = entry_id.split("-")
    return f"{ms}-{int(seq) + 1}"


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


@dataclass(frozen=True)
class StreamEntry:
    """One delivered entry. `deliveries`: how often the group delivered it (1 = first time)."""

    stream: str
    entry_id: str
    fields: dict[str, bytes] = field(repr=False)
    deliveries: int = 1

    @property
    def pb(self) -> bytes:
        return self.fields.get("pb", b"")

    def text(self, name: str, default: str = "") -> str:
        value = self.fields.get(name)
        return default if value is None else _s(value)


# KEYS[1] stream; ARGV[1] group, ARGV[2] min idle ms. Deletes consumers of the group that have no
# pending entries and were idle at least ARGV[2] ms; returns their names. Atomic, so a consumer
# cannot receive an entry between the check and the delete.
_DELETE_IDLE_CONSUMERS_SCRIPT = """
local deleted = {}
for _, info in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local c = {}
  for i = 1, #info, 2 do c[info[i]] = info[i + 1] end
  if tonumber(c['pending']) == 0 and tonumber(c['idle']) >= tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], c['name'])
    deleted[#deleted + 1] = c['name']
  end
end
return deleted
"""


@dataclass(frozen=True)
class OutgoingEntry:
    """One entry to append: `pb` (serialized protobuf), an optional idempotency key, routing fields."""

    pb: bytes
    idempotency_key: str | None = None
    fields: Mapping[str, str | int | bytes] = field(default_factory=dict)


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
        idempotency_ttl_s: int = 7 * 24 * 3600,
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

    async def add(self, pb: bytes, *, idempotency_key: str | None = None, **fields: str | int | bytes) -> tuple[str, bool]:
        """XADD `pb` with routing `fields`. Returns (entry_id, duplicate).

        With `idempotency_key`, a second add of the same key (within `idempotency_ttl_s`) appends
        nothing and returns the first entry's id with `duplicate=True` ("" in the rare case that a
        crash right after the first add left its id unrecorded; the key still counts).
        """
        (result,) = await self._add_entries([OutgoingEntry(pb, idempotency_key, fields)])
        await self._after_adds(1)
        return result

    async def add_many(self, entries: Sequence[OutgoingEntry]) -> list[tuple[str, bool]]:
        """`add` for several entries in one transaction: all new entries of the batch are appended
        or none (MULTI/EXEC), each at most once per idempotency key. Returns [(entry_id, duplicate)]
        in order."""
        if not entries:
            return []
        out = await self._add_entries(entries)
        await self._after_adds(len(entries))
        return out

    async def _add_entries(
        self, entries: Sequence[OutgoingEntry], ack: tuple[str, str, str] | None = None
    ) -> list[tuple[str, bool]]:
        """Append `entries` unless their idempotency key exists, and XACK `ack` = (stream, group,
        entry_id), all in one MULTI/EXEC under WATCH of the keys (a concurrent add of the same key
        aborts the transaction, which is then re-run and sees the key).

        Why not one Lua script: Redis copies every argument into Lua and back, which measured
        ~85 µs per 34 KB trajectory on the server versus ~15 µs for XADD + SET
        (benchmarks/bench_streams.py). Costs 2 round trips (3 with new keys: the entry ids are
        written into the keys after EXEC) per call, whatever the batch size.
        """
        keys = [idempotency_key(self.stream, e.idempotency_key) if e.idempotency_key else "" for e in entries]
        watched = sorted({k for k in keys if k})
        for _ in range(_WATCH_ATTEMPTS):
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    existing: dict[str, bytes] = {}
                    if watched:
                        await pipe.watch(*watched)
                        existing = {k: v for k, v in zip(watched, await pipe.mget(watched)) if v is not None}
                    pipe.multi()
                    plan: list[tuple[str, object]] = []  # ("dup", id) | ("new", key) | ("same", index)
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
                    if ack is not None:
                        pipe.xack(*ack)
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
            if recorded:  # best effort: a crash here leaves _UNRECORDED, which still marks the key used
                async with self.redis.pipeline(transaction=False) as pipe:
                    for key, entry_id in recorded.items():
                        pipe.set(key, entry_id, xx=True, keepttl=True)
                    await pipe.execute()
            dups = sum(dup for _, dup in out)
            if dups:
                DUPLICATES.labels(self.stream).inc(dups)
            return out
        raise RuntimeError(f"{self.stream}: idempotency keys kept changing during {_WATCH_ATTEMPTS} attempts")

    async def _after_adds(self, n: int) -> None:
        if self.maxlen is None:
            return
        self._adds_since_trim += n
        if self._adds_since_trim >= self.trim_every:
            self._adds_since_trim = 0
            await self.trim_acknowledged(self.maxlen)

    async def backlog(self, group: str) -> int:
        """Entries of `stream` that `group` has not acknowledged: pending + not yet delivered."""
        for info in await self._groups():
            if info["name"] == group:
                lag = info.get("lag")
                if lag is None:  # Redis cannot tell after XDEL in the middle: count from the stream
                    lag = await self._undelivered(info["last-delivered-id"])
                return int(info["pending"]) + int(lag)
        return int(await self.redis.xlen(self.stream))  # group not created yet: everything is backlog

    async def wait_for_backlog_below(self, group: str, bound: int, *, poll_s: float = 0.2, timeout_s: float | None = None) -> float:
        """Backpressure: wait while `group`'s backlog is at or above `bound`. Returns seconds waited.

        Raises TimeoutError after `timeout_s` (None = wait forever).
        """
        start = time.monotonic()
        while await self.backlog(group) >= bound:
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise TimeoutError(f"{self.stream}: backlog of group {group} stayed >= {bound} for {timeout_s}s")
            await asyncio.sleep(poll_s)
        return time.monotonic() - start

    async def trim_acknowledged(self, maxlen: int) -> int:
        """If XLEN > maxlen, drop entries that every group has delivered and acknowledged.

        Never removes an entry that is pending or undelivered in any group; a stream without
        groups is never trimmed. XTRIM MINID ~ trims whole radix-tree nodes only, so it may keep
        some acknowledged entries, never the reverse. Returns the number of entries removed.
        """
        length = int(await self.redis.xlen(self.stream))
        if length <= maxlen:
            return 0
        groups = await self._groups()
        if not groups:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for info in groups:
                pipe.xpending(self.stream, info["name"])
            summaries = await pipe.execute()
        bounds = []
        for info, summary in zip(groups, summaries):
            bound = _next_id(_s(info["last-delivered-id"]))
            if summary["pending"]:
                bound = min(bound, _s(summary["min"]), key=_id_key)
            bounds.append(bound)
        threshold = min(bounds, key=_id_key)
        removed = int(await self.redis.xtrim(self.stream, minid=threshold, approximate=True))
        if removed:
            TRIMMED.labels(self.stream).inc(removed)
        return removed

    async def _groups(self) -> list[dict]:
        try:
            raw = await self.redis.xinfo_groups(self.stream)
        except ResponseError:  # no such key
            return []
        out = []
        for info in raw:
            info = {_s(k): v for k, v in info.items()}
            info["name"] = _s(info["name"])
            out.append(info)
        return out

    async def _undelivered(self, last_delivered) -> int:
        """Entries after `last_delivered`, counted in pages (only when XINFO's lag is unknown)."""
        count, start = 0, f"({_s(last_delivered)}"
        while True:
            page = await self.redis.xrange(self.stream, min=start, max="+", count=1000)
            count += len(page)
            if len(page) < 1000:
                return count
            start = f"({_s(page[-1][0])}"


class StreamConsumer:
    """Reads one stream as consumer `consumer` of group `group`.

    Order of `read()`: this consumer's own pending entries once at start (recovery after a
    restart with the same name), entries of idle consumers (XAUTOCLAIM, at most every
    `claim_interval_s`), then new entries (blocking up to `block_ms`).

    block_ms: blocking read time, ms (0 < block_ms < MAX_BLOCK_MS and below half the client's
    socket timeout; ValueError otherwise). count: entries per read (XREADGROUP COUNT).
    claim_min_idle_ms: an entry unacknowledged this long is re-claimed from its consumer.
    max_deliveries: deliveries after which an entry that fails (or whose consumers keep
    crashing) goes to `shellrl:dead`.
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
    ) -> None:
        check_block_ms(redis, block_ms)
        if count < 1 or max_deliveries < 1:
            raise ValueError(f"count and max_deliveries must be >= 1; got {count}, {max_deliveries}")
        self.redis, self.stream, self.group, self.consumer = redis, stream, group, consumer
        self.block_ms, self.count = block_ms, count
        self.claim_min_idle_ms, self.claim_interval_s = claim_min_idle_ms, claim_interval_s
        self.max_deliveries, self.dead_stream = max_deliveries, dead_stream
        self._recovered = False
        self._last_claim = 0.0
        self._errors: dict[str, str] = {}

    async def ensure_group(self, start_id: str = "0") -> None:
        """Create the group (and the stream) if missing; `start_id="0"` delivers existing entries."""
        try:
            await self.redis.xgroup_create(self.stream, self.group, id=start_id, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, count: int | None = None, block_ms: int | None = None) -> list[StreamEntry]:
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
                return await self._filter_poison(own)
        if time.monotonic() - self._last_claim >= self.claim_interval_s:
            self._last_claim = time.monotonic()
            claimed = await self.claim_idle(count)
            if claimed:
                return claimed
        resp = await self.redis.xreadgroup(
            self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms or None
        )
        return [StreamEntry(self.stream, _s(eid), _fields(f), 1) for _, entries in resp or [] for eid, f in entries]

    async def _read_own_pending(self, count: int) -> list[StreamEntry]:
        resp = await self.redis.xreadgroup(self.group, self.consumer, {self.stream: "0"}, count=count)
        entries = [(_s(eid), f) for _, es in resp or [] for eid, f in es]
        deleted = [eid for eid, f in entries if not f]
        if deleted:  # trimmed while pending (cannot happen through trim_acknowledged): drop refs
            await self.redis.xack(self.stream, self.group, *deleted)
        live = [(eid, f) for eid, f in entries if f]
        counts = await self._delivery_counts([eid for eid, _ in live])
        return [StreamEntry(self.stream, eid, _fields(f), counts.get(eid, 1)) for eid, f in live]

    async def claim_idle(self, count: int | None = None) -> list[StreamEntry]:
        """XAUTOCLAIM entries idle longer than `claim_min_idle_ms`, following the cursor to the end
        (known_pitfalls C30: a reclaimer that drops the cursor never sees entries past the first page)."""
        out: list[StreamEntry] = []
        cursor = "0-0"
        want = count or self.count
        while len(out) < want:
            resp = await self.redis.xautoclaim(
                self.stream, self.group, self.consumer, self.claim_min_idle_ms, start_id=cursor, count=want - len(out)
            )
            cursor, claimed = _s(resp[0]), resp[1]
            live = [(_s(eid), f) for eid, f in claimed if f]
            if live:
                counts = await self._delivery_counts([eid for eid, _ in live])
                out += [StreamEntry(self.stream, eid, _fields(f), counts.get(eid, 2)) for eid, f in live]
            if cursor == "0-0":
                break
        if out:
            RECLAIMED.labels(self.stream, self.group).inc(len(out))
            log.warning("re-claimed idle entries", extra={"stream": self.stream, "group": self.group, "count": len(out)})
        return await self._filter_poison(out)

    async def _delivery_counts(self, ids: list[str]) -> dict[str, int]:
        """times_delivered of each id, from XPENDING (one round trip)."""
        if not ids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for eid in ids:
                pipe.xpending_range(self.stream, self.group, min=eid, max=eid, count=1)
            results = await pipe.execute()
        return {eid: int(rows[0]["times_delivered"]) for eid, rows in zip(ids, results) if rows}

    async def _filter_poison(self, entries: list[StreamEntry]) -> list[StreamEntry]:
        keep = []
        for e in entries:
            if e.deliveries > self.max_deliveries:
                reason = self._errors.pop(e.entry_id, None) or await self._stored_error(e.entry_id)
                await self.dead_letter(e, f"delivered {e.deliveries} times without acknowledgement; last error: "
                                          f"{reason or 'consumer crashed or timed out'}")
            else:
                keep.append(e)
        return keep

    async def _stored_error(self, entry_id: str) -> str | None:
        raw = await self.redis.hget(self._error_key, entry_id)
        return _s(raw) if raw is not None else None

    @property
    def _error_key(self) -> str:
        return f"shellrl:errors:{self.stream}:{self.group}"

    async def ack(self, *entry_ids: str) -> int:
        """XACK `entry_ids` (one round trip for any number). Returns how many were pending."""
        if not entry_ids:
            return 0
        for eid in entry_ids:
            self._errors.pop(eid, None)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.stream, self.group, *entry_ids)
            pipe.hdel(self._error_key, *entry_ids)
            acked, _ = await pipe.execute()
        return int(acked)

    async def fail(self, entry: StreamEntry, reason: str) -> None:
        """Handling `entry` failed: leave it pending for a retry (re-claimed after
        `claim_min_idle_ms`), or dead-letter it when it has had `max_deliveries` deliveries."""
        if entry.deliveries >= self.max_deliveries:
            await self.dead_letter(entry, f"failed {entry.deliveries} times; last error: {reason}")
            return
        self._errors[entry.entry_id] = reason
        await self.redis.hset(self._error_key, entry.entry_id, reason[:2000])
        log.warning("entry failed; will retry", extra={"stream": self.stream, "entry_id": entry.entry_id,
                                                      "deliveries": entry.deliveries, "reason": reason[:500]})

    async def dead_letter(self, entry: StreamEntry, reason: str) -> None:
        """Move `entry` to the dead-letter stream with `reason`, and acknowledge it (atomically).

        The dead entry keeps the original fields (`pb`, routing fields) and adds `source_stream`,
        `group`, `entry_id`, `reason`, `deliveries` (these win over original fields of that name).
        """
        self._errors.pop(entry.entry_id, None)
        fields = {**entry.fields, "source_stream": self.stream, "group": self.group, "entry_id": entry.entry_id,
                  "reason": reason[:4000], "deliveries": str(entry.deliveries)}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self.dead_stream, fields)
            pipe.xack(self.stream, self.group, entry.entry_id)
            pipe.hdel(self._error_key, entry.entry_id)
            await pipe.execute()
        DEAD_LETTERS.labels(self.stream, self.group).inc()
        log.error("dead-lettered entry", extra={"stream": self.stream, "group": self.group,
                                                 "entry_id": entry.entry_id, "reason": reason[:500]})

    async def forward(
        self, entry: StreamEntry, to: StreamProducer, pb: bytes, *, idempotency_key: str, **fields
    ) -> tuple[str, bool]:
        """Append `pb` to `to.stream` and acknowledge `entry`, atomically (one MULTI/EXEC).

        Returns (downstream entry_id, duplicate). A re-delivered entry whose result was already
        appended under `idempotency_key` is only acknowledged.
        """
        self._errors.pop(entry.entry_id, None)
        (result,) = await to._add_entries([OutgoingEntry(pb, idempotency_key, fields)],
                                          ack=(self.stream, self.group, entry.entry_id))
        await self.redis.hdel(self._error_key, entry.entry_id)
        await to._after_adds(1)
        return result

    async def delete_idle_consumers(self, min_idle_ms: int) -> list[str]:
        """Remove consumers of this group idle >= `min_idle_ms` that hold no pending entries.

        A consumer with pending entries is never deleted (DELCONSUMER would drop its entries;
        known_pitfalls C30): re-claim them first. Returns the deleted consumer names.
        """
        script = self.redis.register_script(_DELETE_IDLE_CONSUMERS_SCRIPT)
        try:
            names = await script(keys=[self.stream], args=[self.group, int(min_idle_ms)])
        except ResponseError as exc:
            if "no such key" in str(exc).lower() or "NOGROUP" in str(exc):
                return []
            raise
        return [_s(n) for n in names]

    async def stats(self) -> dict[str, int]:
        """{"length", "pending", "lag"} of this stream/group; also sets the stream gauges."""
        length = int(await self.redis.xlen(self.stream))
        pending = lag = 0
        producer = StreamProducer(self.redis, self.stream)
        for info in await producer._groups():
            if info["name"] == self.group:
                pending = int(info["pending"])
                lag = info.get("lag")
                lag = int(lag) if lag is not None else await producer._undelivered(info["last-delivered-id"])
        STREAM_LENGTH.labels(self.stream).set(length)
        STREAM_PENDING.labels(self.stream, self.group).set(pending)
        STREAM_LAG.labels(self.stream, self.group).set(lag)
        return {"length": length, "pending": pending, "lag": lag}


def _flat_fields(e: OutgoingEntry) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {"pb": e.pb}
    for name, value in e.fields.items():
        out[name] = value if isinstance(value, bytes) else str(value)
    return out


def _fields(raw: dict) -> dict[str, bytes]:
    return {_s(k): v for k, v in raw.items()}
