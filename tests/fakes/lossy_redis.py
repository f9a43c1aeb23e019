"""LosesDeliveredBatches: wraps a real asyncio Redis client (shellrl.streams.connect) for a stream
consumer, to inject client-side read timeouts after the server delivered.

The first `failures` new-entry reads (XREADGROUP with id ">") run on the server, so Redis delivers
the batch and records it pending for the consumer, and then raise redis' TimeoutError, as redis-py
does when a large reply arrives late on a busy loop. Every other call goes to the real client.
"""

from __future__ import annotations

from redis.exceptions import TimeoutError as RedisTimeoutError


class LosesDeliveredBatches:
    def __init__(self, redis, failures: int) -> None:
        self.redis, self.failures = redis, failures

    def __getattr__(self, name):
        return getattr(self.redis, name)

    async def xreadgroup(self, group, consumer, streams, **kwargs):
        reply = await self.redis.xreadgroup(group, consumer, streams, **kwargs)
        if self.failures > 0 and list(streams.values()) == [">"]:
            self.failures -= 1
            raise RedisTimeoutError("Timeout reading from socket")
        return reply
