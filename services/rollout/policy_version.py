"""The learner's policy version as the gateway sees it: `shellrl:policy:version` is the truth,
`shellrl:policy:updates` (pub/sub) only wakes the watcher up. Admission (admission.py) waits on
it for the staleness bound to move.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_fixed

from services.rollout import metrics as m
from shellrl.streams import POLICY_UPDATES_CHANNEL, POLICY_VERSION_KEY

log = logging.getLogger(__name__)


class PolicyVersionWatcher:
    """Tracks `shellrl:policy:version`: pub/sub messages wake it, a poll every `poll_s` is the fallback."""

    def __init__(self, redis: aioredis.Redis, *, poll_s: float = 1.0) -> None:
        self.redis, self.poll_s = redis, poll_s
        self.version = 0
        self._changed = asyncio.Event()

    async def read(self) -> int:
        raw = await self.redis.get(POLICY_VERSION_KEY)
        version = int(raw) if raw is not None else 0
        if version != self.version:
            self.version = version
            m.POLICY_VERSION.set(version)
            self.wake()
        return version

    def wake(self) -> None:
        self._changed.set()

    async def wait(self, timeout_s: float) -> None:
        """Until the version changes (or anything else calls `wake`), at most `timeout_s`."""
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            pass
        self._changed.clear()

    async def run(self) -> None:
        """Forever: listen on shellrl:policy:updates and poll the key; survives Redis outages
        (any error is retried every `poll_s`, tenacity)."""
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(Exception),
            wait=wait_fixed(self.poll_s),
            before_sleep=_watch_failed,
        ):
            with attempt:
                await self._listen()

    async def _listen(self) -> None:
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(POLICY_UPDATES_CHANNEL)
            await self.read()
            while True:
                await pubsub.get_message(ignore_subscribe_messages=True, timeout=self.poll_s)
                await self.read()
        finally:
            try:
                await pubsub.aclose()
            except Exception as exc:  # closing a dead connection: nothing left to release
                log.debug("closing pub/sub: %s", exc)


def _watch_failed(state: RetryCallState) -> None:
    log.warning("policy version watcher: %s", state.outcome.exception())  # Redis restarting
