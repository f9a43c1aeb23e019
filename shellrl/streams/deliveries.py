"""Delivery bookkeeping of a stream consumer: handling attempts per entry, the last error of each,
poison entries and dead letters. `StreamConsumer` (consumer.py) owns one `DeliveryLedger` and hands
every entry it reads through `hand_out`.

Redis keys (keys.py): `attempts_key(stream, group)` (hash: entry id -> handling attempts) and
`errors_key(stream, group)` (hash: entry id -> last error), both cleared when an entry is
acknowledged, forwarded or dead-lettered; dead letters go to `shellrl:dead`; `lost_key(stream)`
(hash: group -> pending entries trimmed away before they were handled; read by `shellrl status`).
Entries held (handed out, not yet done) can be renewed: their idle time is reset so another
consumer's XAUTOCLAIM leaves them alone however long handling takes.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from shellrl.streams.entry import StreamEntry, _fields, _s
from shellrl.streams.keys import attempts_key, errors_key, lost_key
from shellrl.streams.metrics import DEAD_LETTERS, LOST

log = logging.getLogger("shellrl.streams")

DEAD_LETTERS_KEPT = 10_000  # newest entries kept in shellrl:dead

# KEYS[1] stream; ARGV[1] group, ARGV[2] consumer, ARGV[3..] entry ids. Each id still pending to
# this consumer is claimed again by it (XCLAIM JUSTID: idle time 0, no delivery counted); an id
# another consumer re-claimed meanwhile stays with that one. Returns how many were renewed.
_RENEW = """
local n = 0
for i = 3, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) > 0 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    n = n + 1
  end
end
return n
"""

# KEYS[1] attempts hash; ARGV: entry ids. Counts one handling attempt of each (HINCRBY) and
# returns the counts in order: one command a read, not one an entry (the learner's intake spent
# half its CPU packing a pipeline of one HINCRBY an entry: BENCHMARKS.md, "The learner's intake").
_HAND_OUT = """
local out = {}
for i = 1, #ARGV do out[i] = redis.call('HINCRBY', KEYS[1], ARGV[i], 1) end
return out
"""


class DeliveryLedger:
    """Handling attempts of the entries one consumer of `group` reads from `stream`.

    max_deliveries: attempts after which an entry that fails (or whose consumers keep crashing)
    goes to `dead_stream`, which keeps the newest `dead_maxlen` entries.
    """

    def __init__(
        self,
        redis: aioredis.Redis,
        stream: str,
        group: str,
        *,
        max_deliveries: int,
        dead_stream: str,
        dead_maxlen: int,
    ) -> None:
        self.redis, self.stream, self.group = redis, stream, group
        self.max_deliveries, self.dead_stream, self.dead_maxlen = (
            max_deliveries,
            dead_stream,
            dead_maxlen,
        )
        self._errors: dict[str, str] = {}
        self._in_flight: set[str] = set()  # handed out by this object, not yet acked/failed
        self._renew = redis.register_script(_RENEW)
        self._hand_out = redis.register_script(_HAND_OUT)

    @property
    def error_key(self) -> str:
        return errors_key(self.stream, self.group)

    @property
    def attempts_key(self) -> str:
        return attempts_key(self.stream, self.group)

    async def hand_out(self, raw: list[tuple[str, dict]]) -> list[StreamEntry]:
        """Entries to give the caller: those not already in flight here, each counted as one
        handling attempt; an entry past `max_deliveries` attempts is dead-lettered instead."""
        raw = [(eid, f) for eid, f in raw if eid not in self._in_flight]
        if not raw:
            return []
        attempts = await self._hand_out(keys=[self.attempts_key], args=[eid for eid, _ in raw])
        entries = [
            StreamEntry(self.stream, eid, _fields(f), int(n)) for (eid, f), n in zip(raw, attempts)
        ]
        entries = await self._filter_poison(entries)
        self._in_flight.update(e.entry_id for e in entries)
        return entries

    async def renew(self, consumer: str) -> int:
        """Reset the idle time of the held entries still pending to `consumer` (one script call;
        see _RENEW). Returns how many were renewed."""
        held = sorted(self._in_flight)
        if not held:
            return 0
        return int(await self._renew(keys=[self.stream], args=[self.group, consumer, *held]))

    async def lost(self, entry_ids: list[str], *, ack: bool) -> None:
        """Entries that were pending here but trimmed from the stream: never handled, counted and
        logged by id (shellrl_stream_lost_total{stream,group}, and in `lost_key(stream)`, which
        outlives this process: `shellrl status` shows it). ack: also drop their references from
        the pending list, in the same transaction as the count (XAUTOCLAIM has dropped them)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            if ack:
                pipe.xack(self.stream, self.group, *entry_ids)
            pipe.hincrby(lost_key(self.stream), self.group, len(entry_ids))
            await pipe.execute()
        LOST.labels(self.stream, self.group).inc(len(entry_ids))
        log.error(
            "pending entries were trimmed before they were handled (lost)",
            extra={
                "stream": self.stream,
                "group": self.group,
                "entry_ids": entry_ids[:100],
                "count": len(entry_ids),
            },
        )

    async def _filter_poison(self, entries: list[StreamEntry]) -> list[StreamEntry]:
        keep = []
        for e in entries:
            if e.deliveries > self.max_deliveries:
                reason = self._errors.pop(e.entry_id, None) or await self._stored_error(e.entry_id)
                await self.dead_letter(
                    e,
                    f"delivered {e.deliveries} times without acknowledgement; last error: "
                    f"{reason or 'consumer crashed or timed out'}",
                )
            else:
                keep.append(e)
        return keep

    async def _stored_error(self, entry_id: str) -> str | None:
        raw = await self.redis.hget(self.error_key, entry_id)
        return _s(raw) if raw is not None else None

    def done(self, *entry_ids: str) -> None:
        """Forget `entry_ids` here (acknowledged, forwarded or dead-lettered)."""
        for eid in entry_ids:
            self._errors.pop(eid, None)
            self._in_flight.discard(eid)

    async def fail(self, entry: StreamEntry, reason: str) -> None:
        """See `StreamConsumer.fail`."""
        if entry.deliveries >= self.max_deliveries:
            await self.dead_letter(entry, f"failed {entry.deliveries} times; last error: {reason}")
            return
        self._in_flight.discard(entry.entry_id)  # handed out again after a re-claim
        self._errors[entry.entry_id] = reason
        await self.redis.hset(self.error_key, entry.entry_id, reason[:2000])
        log.warning(
            "entry failed; will retry",
            extra={
                "stream": self.stream,
                "entry_id": entry.entry_id,
                "deliveries": entry.deliveries,
                "reason": reason[:500],
            },
        )

    async def dead_letter(self, entry: StreamEntry, reason: str) -> None:
        """See `StreamConsumer.dead_letter`."""
        self.done(entry.entry_id)
        fields = {
            **entry.fields,
            "source_stream": self.stream,
            "group": self.group,
            "entry_id": entry.entry_id,
            "reason": reason[:4000],
            "deliveries": str(entry.deliveries),
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self.dead_stream, fields, maxlen=self.dead_maxlen, approximate=False)
            pipe.xack(self.stream, self.group, entry.entry_id)
            pipe.hdel(self.error_key, entry.entry_id)
            pipe.hdel(self.attempts_key, entry.entry_id)
            await pipe.execute()
        DEAD_LETTERS.labels(self.stream, self.group).inc()
        log.error(
            "dead-lettered entry",
            extra={
                "stream": self.stream,
                "group": self.group,
                "entry_id": entry.entry_id,
                "reason": reason[:500],
            },
        )
