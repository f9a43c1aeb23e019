"""The asyncio Redis client every shellrl service uses: socket timeout above every blocking read,
writes that never swallow a cancel, and the block_ms rule (ecosystem.md section 1.1)."""

from __future__ import annotations

import asyncio
import sys

import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeoutError

SOCKET_TIMEOUT_S = 30.0
MAX_BLOCK_MS = 5_000  # keep blocking reads far below SOCKET_TIMEOUT_S


class CancelSafeConnection(aioredis.Connection):
    """redis-py's TCP connection whose command write is bounded by `asyncio.timeout` instead of
    `asyncio.wait_for` (Python < 3.12 only; later versions use the base class as is).

    redis-py writes every command under `asyncio.wait_for(..., socket_timeout)`, which runs the
    write as a separate task. On Python 3.11 a cancel that lands between that task finishing and
    the caller waking is dropped (cpython gh-86296). A consumer loop doing back-to-back XREADGROUP
    and XADD is in that window so often that, with 3 busy processes on this 2-core VM, four cancels
    one second apart all missed it within 3 s (tests/service/test_cancel.py failed in CI that way).
    `asyncio.timeout` bounds the same write inside the caller's task, so a cancel always reaches it;
    a write that exceeds `socket_timeout` still raises redis' TimeoutError and drops the connection.
    """

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        timeout_s = self.socket_timeout
        if not timeout_s or sys.version_info >= (3, 12):
            return await super().send_packed_command(command, check_health)
        # While socket_timeout is None the base class writes without wait_for, and the health-check
        # PING it may send reads without its own timeout: asyncio.timeout bounds both.
        self.socket_timeout = None
        try:
            async with asyncio.timeout(timeout_s):
                await super().send_packed_command(command, check_health)
        except TimeoutError:
            await self.disconnect(nowait=True)
            raise RedisTimeoutError("Timeout writing to socket") from None
        finally:
            self.socket_timeout = timeout_s


def pool_kwargs(url: str) -> dict:
    """Connection-pool keyword arguments every shellrl asyncio client uses for `url`: the socket
    timeout, a health check, and `CancelSafeConnection` for plain TCP (redis://) URLs."""
    kwargs = {"socket_timeout": SOCKET_TIMEOUT_S, "health_check_interval": 15}
    if url.startswith("redis://"):
        kwargs["connection_class"] = CancelSafeConnection
    return kwargs


def connect(url: str, **kwargs) -> aioredis.Redis:
    """An asyncio Redis client for binary payloads, with a socket timeout above every block_ms and
    writes that never swallow a cancel (`CancelSafeConnection`)."""
    for key, value in pool_kwargs(url).items():
        kwargs.setdefault(key, value)
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
