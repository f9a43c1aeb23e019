"""An `EngineClient` that stops a push between two buckets.

Replaces: shellrl.clients.engine.EngineClient in tests of pushes interrupted mid-way or overlapped
by another push (the real client otherwise). The fault: once `after` bucket calls
(`update_weights_from_tensor` or `update_weights_from_distributed`) of this client returned, it
sets `between_buckets` and holds the answer until the test sets `release` (never set: the push
waits there until it is cancelled)."""

from __future__ import annotations

import asyncio

from shellrl.clients.engine import EngineClient


class GatedBucketClient(EngineClient):
    def __init__(self, *args, after: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.after, self.calls = after, 0  # bucket calls that returned
        self.between_buckets, self.release = asyncio.Event(), asyncio.Event()

    async def _gate(self, answer):
        self.calls += 1
        if self.calls == self.after:
            self.between_buckets.set()
            await self.release.wait()
        return answer

    async def update_weights_from_tensor(self, serialized_named_tensors, **kwargs):
        return await self._gate(
            await super().update_weights_from_tensor(serialized_named_tensors, **kwargs)
        )

    async def update_weights_from_distributed(self, *args, **kwargs):
        return await self._gate(await super().update_weights_from_distributed(*args, **kwargs))
