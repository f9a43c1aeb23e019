"""The training data path's streams (shellrl:episodes, shellrl:trajectories) sharded across Redis
instances, so that no one Redis thread carries every episode of a cluster (issue 35: one Redis
thread at 70% carries about 41-60 engines' episodes, BENCHMARKS.md "The control plane at cluster
scale").

Layout. The control Redis (`redis_url`, index 0) keeps admission, the task pool, task
statistics, policy versions, evaluations, and the streams of whatever has no group (evaluation
episodes, whose results go to shellrl:evaluations there). The stream shards, indices 1..N, are the
Redis instances of `stream_shard_urls`; each holds only shellrl:episodes and shellrl:trajectories
(with their idempotency keys and delivery bookkeeping). A training episode goes to shard
`1 + crc32(group_id) mod N` (`shard_of`): every episode of one group on one shard, and the
verifier's forward from shellrl:episodes to shellrl:trajectories stays one Lua script on one
Redis (the atomic append-and-acknowledge of `StreamConsumer.forward`). Consumers read index 0 too.

Entry ids. A consumer reading several instances tags the ids of index k > 0 as
`"<k>@<ms>-<seq>"` (`tag` / `untag`); the control Redis's ids are plain. Without stream shards
(N = 0, the default) nothing is tagged and `StreamShards.producer` / `.consumer` return the plain
`StreamProducer` / `StreamConsumer`: the single-Redis deployment behaves exactly as before.

Reading several instances. `ShardedStreamConsumer.take` keeps one read in flight per instance
and returns what the first shards to answer delivered (each at most `count`); a read still blocking on an
idle shard stays in flight for the next call. So an entry on a busy shard never waits for an idle
one's `block_ms`. A read in flight when the consumer closes is cancelled: whatever it delivered is
in this consumer's pending list on that shard, handed out again after a restart under the same
name or re-claimed by another consumer (the guarantees of consumer.py, per shard).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import zlib
from collections.abc import Awaitable, Callable, Sequence

import redis.asyncio as aioredis

from shellrl.service.settings import parse_shard_urls
from shellrl.streams.connection import connect
from shellrl.streams.consumer import StreamConsumer, batch_loop
from shellrl.streams.entry import StreamEntry
from shellrl.streams.producer import StreamProducer, wait_while_backlog
from shellrl.streams.stats import STATS_INTERVAL_S, export_stream_stats, stream_stats

log = logging.getLogger("shellrl.streams")
SHARD_MARK = "@"
__all__ = [
    "ShardedStreamConsumer",
    "ShardedStreamProducer",
    "StreamShards",
    "parse_shard_urls",
    "producer_for_entry",
    "shard_of",
    "tag",
    "untag",
]


def shard_of(group_id: str, shards: int) -> int:
    """The index of the Redis holding group `group_id`'s episodes when `shards` stream shards
    follow the control Redis: 1 + crc32 of its UTF-8 bytes mod `shards` (zlib.crc32, the same on
    every host and Python version); 0 (the control Redis) for an empty group id (an evaluation
    episode) or no shards. Raises ValueError for shards < 0."""
    if shards < 0:
        raise ValueError(f"shards must be >= 0; got {shards}")
    if shards == 0 or not group_id:
        return 0
    return 1 + zlib.crc32(group_id.encode()) % shards


def tag(entry_id: str, shard: int) -> str:
    """`entry_id` of instance `shard` as a sharded consumer hands it out (0, the control Redis:
    unchanged)."""
    return entry_id if shard == 0 else f"{shard}{SHARD_MARK}{entry_id}"


def untag(entry_id: str) -> tuple[int, str]:
    """(shard, Redis entry id) of an id from `tag`. Raises ValueError for a malformed tag."""
    shard, mark, plain = entry_id.partition(SHARD_MARK)
    if not mark:
        return 0, entry_id
    if not shard.isdigit() or int(shard) < 1 or not plain:
        raise ValueError(f"not a sharded stream entry id: {entry_id!r}")
    return int(shard), plain


class StreamShards:
    """The Redis clients of the streams: `clients[0]` the control Redis (owned by the caller),
    `clients[1:]` the stream shards, one per `stream_shard_urls` entry, made by `connect_url`
    (default `shellrl.streams.connect`) and owned here: `aclose` closes them. `len()` counts all.
    Connects nothing yet."""

    def __init__(
        self,
        control: aioredis.Redis,
        shard_urls: Sequence[str] = (),
        *,
        connect_url: Callable[[str], aioredis.Redis] = connect,
    ) -> None:
        self.clients: list[aioredis.Redis] = [control, *(connect_url(u) for u in shard_urls)]
        self.urls = list(shard_urls)

    def __len__(self) -> int:
        return len(self.clients)

    def for_group(self, group_id: str) -> aioredis.Redis:
        """The client of the shard holding group `group_id`'s episodes and trajectories."""
        return self.clients[shard_of(group_id, len(self.clients) - 1)]

    def producer(self, stream: str, **kwargs) -> StreamProducer | ShardedStreamProducer:
        """A producer of `stream` (StreamProducer's keyword arguments): the plain one on the
        control Redis without stream shards, else a `ShardedStreamProducer`."""
        if len(self.clients) == 1:
            return StreamProducer(self.clients[0], stream, **kwargs)
        return ShardedStreamProducer([StreamProducer(c, stream, **kwargs) for c in self.clients])

    def consumer(
        self, stream: str, group: str, consumer: str, **kwargs
    ) -> StreamConsumer | ShardedStreamConsumer:
        """A consumer of `stream` in `group` (StreamConsumer's keyword arguments), named
        `consumer` on every instance: the plain one on the control Redis without stream shards,
        else a `ShardedStreamConsumer` of the control Redis and every shard."""
        parts = [StreamConsumer(c, stream, group, consumer, **kwargs) for c in self.clients]
        return parts[0] if len(parts) == 1 else ShardedStreamConsumer(parts)

    async def export_shard_stats(
        self, groups: Sequence[tuple[str, str]], interval_s: float = STATS_INTERVAL_S
    ) -> None:
        """`export_stream_stats` of `groups` on stream shards 1..N (labels "<stream>@<k>"), until
        cancelled; returns at once without shards (the control Redis's are the caller's own
        watch)."""
        await asyncio.gather(
            *(
                export_stream_stats(c, groups, interval_s, shard=k)
                for k, c in enumerate(self.clients)
                if k > 0
            )
        )

    async def aclose(self) -> None:
        """Close the shard clients this object opened (not the control client)."""
        for client in self.clients[1:]:
            with contextlib.suppress(Exception):
                await client.aclose()


class ShardedStreamProducer:
    """Appends to one stream sharded by group: `shards[0]` on the control Redis, `shards[1:]` on
    the stream shards; an entry goes to the one of its `group_id` field (`shard_of`; the control
    Redis without one). The same add/backlog surface as StreamProducer for the gateway."""

    def __init__(self, shards: Sequence[StreamProducer]) -> None:
        if not shards or len({p.stream for p in shards}) != 1:
            raise ValueError("a sharded producer needs >= 1 producers of one stream")
        self.shards = list(shards)
        self.stream = shards[0].stream

    def for_shard(self, shard: int) -> StreamProducer:
        return self.shards[shard]

    def for_group(self, group_id: str) -> StreamProducer:
        return self.shards[shard_of(group_id, len(self.shards) - 1)]

    async def add(self, pb: bytes, *, idempotency_key: str | None = None, **fields):
        """`StreamProducer.add` on the shard of `fields["group_id"]` (the control Redis without one)."""
        producer = self.for_group(str(fields.get("group_id", "") or ""))
        return await producer.add(pb, idempotency_key=idempotency_key, **fields)

    async def add_retrying(self, pb: bytes, *, idempotency_key: str, **fields):
        """`StreamProducer.add_retrying` on the shard of `fields["group_id"]` (the idempotency key
        lives on that shard: a retry of the same group reaches the same key)."""
        producer = self.for_group(str(fields.get("group_id", "") or ""))
        return await producer.add_retrying(pb, idempotency_key=idempotency_key, **fields)

    async def backlog(self, group: str) -> int:
        """Entries `group` has not acknowledged, summed over the shards."""
        return sum(await asyncio.gather(*(p.backlog(group) for p in self.shards)))

    async def wait_for_backlog_below(
        self, group: str, bound: int, *, poll_s: float = 0.2, timeout_s: float | None = None
    ) -> float:
        """Backpressure on the sum over shards (`backlog`): as StreamProducer's, seconds waited;
        TimeoutError after `timeout_s`."""
        return await wait_while_backlog(self, group, bound, poll_s=poll_s, timeout_s=timeout_s)


def producer_for_entry(to: StreamProducer | ShardedStreamProducer, entry_id: str) -> StreamProducer:
    """The producer of `to`'s stream on the Redis that holds entry `entry_id` (a tagged id), where
    a forward of that entry appends: a sharded `to` gives its producer of the entry's shard; a
    plain `to` (shellrl:evaluations, on the control Redis) takes entries of the control Redis
    only. ValueError for another (its append and the entry's ack could not be atomic)."""
    shard, _ = untag(entry_id)
    if isinstance(to, ShardedStreamProducer):
        return to.for_shard(shard)
    if shard == 0:
        return to
    raise ValueError(
        f"entry {entry_id} of shard {shard} cannot be forwarded to {to.stream} on the control "
        "Redis: an episode without a group id belongs on the control Redis"
    )


class ShardedStreamConsumer:
    """One consumer name in one group on every shard of a stream. Entries carry tagged ids
    (`tag`); `ack`, `fail`, `dead_letter` and `forward` act on the entry's own shard."""

    def __init__(self, shards: Sequence[StreamConsumer]) -> None:
        if len(shards) < 2 or len({(c.stream, c.group, c.consumer) for c in shards}) != 1:
            raise ValueError("a sharded consumer needs >= 2 consumers of one stream, group, name")
        self.shards = list(shards)
        self.stream, self.group, self.consumer = (
            shards[0].stream,
            shards[0].group,
            shards[0].consumer,
        )
        self.claim_min_idle_ms = shards[0].claim_min_idle_ms
        self._reads: list[asyncio.Task | None] = [None] * len(shards)

    # --- reading -------------------------------------------------------------------------------

    async def ensure_group(self, start_id: str = "0") -> None:
        await asyncio.gather(*(c.ensure_group(start_id) for c in self.shards))

    async def take(self, stop: asyncio.Event, count: int | None = None) -> list[StreamEntry]:
        """`StreamConsumer.take` over the shards: one take in flight per shard; returns the
        entries of every shard whose take has finished (at most `count` each), after waiting for
        the first. [] once `stop` is set and the finished takes delivered nothing. A take that
        raised (take itself retries Redis errors) raises here when no other shard delivered;
        otherwise the entries are returned and that shard is read again by the next call."""
        for k, shard in enumerate(self.shards):
            if self._reads[k] is None:
                self._reads[k] = asyncio.create_task(shard.take(stop, count))
        live = [t for t in self._reads if t is not None]
        await asyncio.wait(live, return_when=asyncio.FIRST_COMPLETED)
        out: list[StreamEntry] = []
        error: BaseException | None = None
        for k, task in enumerate(self._reads):
            if task is not None and task.done():
                self._reads[k] = None
                if task.cancelled() or task.exception() is not None:
                    error = error or (task.exception() or asyncio.CancelledError())
                    continue
                out += [_tagged(e, k) for e in task.result()]
        if error is not None and not out:  # entries handed out are never dropped for an error
            raise error
        if error is not None:
            log.warning(
                "reading one stream shard failed; reading it again next time",
                extra={"stream": self.stream, "group": self.group, "error": repr(error)},
            )
        return out

    async def consume(
        self, stop: asyncio.Event, handle: Callable[[StreamEntry], Awaitable[None]], what: str
    ) -> None:
        """`StreamConsumer.consume` on every shard at once (one loop a shard), entries tagged."""

        def on_shard(k: int) -> Callable[[StreamEntry], Awaitable[None]]:
            return lambda entry: handle(_tagged(entry, k))

        await asyncio.gather(
            *(c.consume(stop, on_shard(k), what) for k, c in enumerate(self.shards))
        )

    async def consume_batches(
        self,
        stop: asyncio.Event,
        handle_batch: Callable[[list[StreamEntry]], Awaitable[None]],
        what: str,
        *,
        min_interval_s: float = 0.0,
    ) -> None:
        """`StreamConsumer.consume_batches` over the shards: each batch is what `take` returned
        (entries of every shard whose read finished, tagged), handled at once."""
        await batch_loop(self, stop, handle_batch, what, min_interval_s)

    async def close(self) -> None:
        """Cancel the takes in flight (what they delivered stays pending on its shard)."""
        tasks = [t for t in self._reads if t is not None]
        self._reads = [None] * len(self.shards)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # --- resolving entries ---------------------------------------------------------------------

    def _own(self, entry: StreamEntry) -> tuple[StreamConsumer, StreamEntry]:
        shard, plain = untag(entry.entry_id)
        return self.shards[shard], dataclasses.replace(entry, entry_id=plain)

    async def ack(self, *entry_ids: str) -> int:
        """XACK tagged `entry_ids` on their shards (one round trip a shard). Returns how many
        were pending, summed."""
        by_shard: dict[int, list[str]] = {}
        for entry_id in entry_ids:
            shard, plain = untag(entry_id)
            by_shard.setdefault(shard, []).append(plain)
        acked = await asyncio.gather(*(self.shards[k].ack(*ids) for k, ids in by_shard.items()))
        return sum(acked)

    async def fail(self, entry: StreamEntry, reason: str) -> None:
        consumer, plain = self._own(entry)
        await consumer.fail(plain, reason)

    async def dead_letter(self, entry: StreamEntry, reason: str) -> None:
        """Dead-letter `entry` into shellrl:dead of its own shard (atomically with the ack)."""
        consumer, plain = self._own(entry)
        await consumer.dead_letter(plain, reason)

    async def forward(
        self,
        entry: StreamEntry,
        to: StreamProducer | ShardedStreamProducer,
        pb: bytes,
        *,
        idempotency_key: str,
        **fields,
    ) -> tuple[str, bool]:
        """`StreamConsumer.forward` on `entry`'s shard into `to`'s stream on the same shard (one
        Lua script on one Redis; `producer_for_entry` picks the producer, ValueError for an entry
        of a stream shard forwarded to a plain producer)."""
        consumer, plain = self._own(entry)
        producer = producer_for_entry(to, entry.entry_id)
        return await consumer.forward(
            plain, producer, pb, idempotency_key=idempotency_key, **fields
        )

    async def renew(self) -> int:
        return sum(await asyncio.gather(*(c.renew() for c in self.shards)))

    async def keep_renewed(self) -> None:
        await asyncio.gather(*(c.keep_renewed() for c in self.shards))

    async def delete_idle_consumers(self, min_idle_ms: int) -> list[str]:
        deleted = await asyncio.gather(*(c.delete_idle_consumers(min_idle_ms) for c in self.shards))
        return sorted({name for names in deleted for name in names})

    async def stats(self) -> dict[str, int]:
        """{"length", "pending", "lag"} summed over the instances (each instance's gauges set,
        labelled as `stream_stats` labels them)."""
        per = await asyncio.gather(
            *(stream_stats(c.redis, c.stream, c.group, k) for k, c in enumerate(self.shards))
        )
        return {key: sum(s[key] for s in per) for key in ("length", "pending", "lag")}


def _tagged(entry: StreamEntry, shard: int) -> StreamEntry:
    return entry if shard == 0 else dataclasses.replace(entry, entry_id=tag(entry.entry_id, shard))
