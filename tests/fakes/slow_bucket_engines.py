"""Engines that read a streamed push's slots slowly, or fail, for tests of the slot schedule.

Replaces: shellrl.clients.engine.EngineClient's `update_weights_from_tensor` as
services/learner/weights/bucket_send.transfer calls it, for engines that only read buckets. The
"slots" are a plain list the test's fill function writes (`slots[s] = bucket index`); an entry
names the slot and the bucket it should hold ("slot:bucket"). Each update call reads its slot when it
starts, waits the engine's `delay_s` (its copy), and reads it again: a slot rewritten under an
outstanding read is recorded in `torn`. `fail_at`: url -> the bucket index whose call raises
EngineError (after its delay); `hang_at`: url -> the bucket index whose call never returns.
`received`: url -> bucket indices read, in order; `outstanding`: the reads in flight now."""

from __future__ import annotations

import asyncio

from shellrl.clients.engine_responses import EngineError


class SlowBucketEngines:
    def __init__(
        self,
        slots: list,
        delay_s: dict[str, float],
        *,
        fail_at: dict[str, int] | None = None,
        hang_at: dict[str, int] | None = None,
    ) -> None:
        self.slots, self.delay_s = slots, delay_s
        self.fail_at, self.hang_at = fail_at or {}, hang_at or {}
        self.received: dict[str, list[int]] = {url: [] for url in delay_s}
        self.labels: dict[str, list[str | None]] = {url: [] for url in delay_s}
        self.torn: list[tuple[str, int, object]] = []
        self.outstanding: set[tuple[str, int]] = set()

    async def update_weights_from_tensor(self, entries, *, weight_version, urls, **_):
        (url,) = urls
        slot, bucket = (int(x) for x in entries[0].split(":"))
        if self.slots[slot] != bucket:
            self.torn.append((url, bucket, self.slots[slot]))
        self.outstanding.add((url, bucket))
        try:
            if self.hang_at.get(url) == bucket:
                await asyncio.Event().wait()  # never set: a frozen engine
            await asyncio.sleep(self.delay_s[url])
            if self.slots[slot] != bucket:
                self.torn.append((url, bucket, self.slots[slot]))
            if self.fail_at.get(url) == bucket:
                raise EngineError(url, 400, f"refused bucket {bucket}")
            self.received[url].append(bucket)
            self.labels[url].append(weight_version)
        finally:
            self.outstanding.discard((url, bucket))
        return {url: None}
