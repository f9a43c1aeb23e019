"""Every Redis-stream rule of shellrl (DESIGN.md section 3), one module per side:

keys.py            every Redis key, stream, group and channel name
connection.py      asyncio client (`connect`): socket timeout, cancel-safe writes, the block_ms rule
entry.py           StreamEntry (read) and OutgoingEntry (to write)
producer.py        StreamProducer: idempotent atomic appends, trimming, backpressure
consumer.py        StreamConsumer: group reads, acknowledge/forward, re-claim, dead letters
deliveries.py      handling attempts per entry, poison entries, dead letters (for the consumer)
consumer_groups.py what groups delivered and acknowledged: backlog, trim, idle consumers
stats.py           stream gauges for /metrics
shards.py          the episodes and trajectories streams sharded across Redis instances
script_batch.py    several Lua script calls in one round trip (a consumer's per-entry bookkeeping)
metrics.py         the stream layer's Prometheus metrics

The names below are the public surface; import them from `shellrl.streams`.
"""

from shellrl.streams.connection import (
    MAX_BLOCK_MS,
    SOCKET_TIMEOUT_S,
    CancelSafeConnection,
    check_block_ms,
    connect,
    pool_kwargs,
)
from shellrl.streams.consumer import StreamConsumer
from shellrl.streams.deliveries import DEAD_LETTERS_KEPT
from shellrl.streams.entry import OutgoingEntry, StreamEntry
from shellrl.streams.keys import (
    GROUP_LEARNER,
    GROUP_ROLLOUT,
    GROUP_VERIFIER,
    POLICY_UPDATES_CHANNEL,
    POLICY_VERSION_KEY,
    STREAM_DEAD,
    STREAM_EPISODES,
    STREAM_EVALUATIONS,
    STREAM_TASKS,
    STREAM_TRAJECTORIES,
    idempotency_key,
    task_key,
)
from shellrl.streams.producer import StreamProducer
from shellrl.streams.shards import (
    ShardedStreamConsumer,
    ShardedStreamProducer,
    StreamShards,
    producer_for_entry,
    shard_of,
    tag,
    untag,
)
from shellrl.streams.stats import STATS_INTERVAL_S, export_stream_stats, stream_stats

__all__ = [
    "DEAD_LETTERS_KEPT",
    "GROUP_LEARNER",
    "GROUP_ROLLOUT",
    "GROUP_VERIFIER",
    "MAX_BLOCK_MS",
    "POLICY_UPDATES_CHANNEL",
    "POLICY_VERSION_KEY",
    "SOCKET_TIMEOUT_S",
    "STATS_INTERVAL_S",
    "STREAM_DEAD",
    "STREAM_EPISODES",
    "STREAM_EVALUATIONS",
    "STREAM_TASKS",
    "STREAM_TRAJECTORIES",
    "CancelSafeConnection",
    "OutgoingEntry",
    "ShardedStreamConsumer",
    "ShardedStreamProducer",
    "StreamConsumer",
    "StreamEntry",
    "StreamProducer",
    "StreamShards",
    "check_block_ms",
    "connect",
    "export_stream_stats",
    "idempotency_key",
    "pool_kwargs",
    "producer_for_entry",
    "shard_of",
    "stream_stats",
    "tag",
    "task_key",
    "untag",
]
