"""One push's buckets streamed through two kept slots, shared by every engine of the push.

    plan: buckets 0..n-1 (split_buckets) ─▶ bucket i filled into slot i % 2 when first asked for
    (and bucket i+1 into the other slot meanwhile) ─▶ each engine's update call for i ─▶ every
    engine answered i (or left the push) ─▶ slot i % 2 may take bucket i+2

Consumes: the plan (a list of buckets, each a list of (name, tensor)), the engines of the push
(their urls) and a `fill(slot, bucket)` that writes a bucket into a kept slot and returns its
`entries(tp_size) -> serialized_named_tensors` (weight_transport.WeightStaging). Produces one
awaitable provider per bucket (`providers[i](tp_size)`) for bucket_send.transfer, which tells
the stream when an engine's update for bucket i returned (`answered`) and when the engine is done
with the push, by success or failure (`leave`).

Guarantees:
* At most two slots are filled at once, whatever the number of buckets: the learner adds two
  buckets of memory to a push (`WeightStaging.resident_bytes`), never the model.
* A slot is refilled for bucket i+2 only after every engine still in the push has had its update
  for bucket i answered. shellrl's engine synchronizes its GPU before it answers
  (services/engine/weights.py `_stage_cuda`), so its answer means its copies are done. SGLang
  0.5.23 answers once its copies are *enqueued* on its stream (scheduler_components/
  weight_updater.py `update_weights_from_tensor`: no synchronize), so against SGLang on a GPU the
  refill relies on those copies finishing within the answer's HTTP round trip (with the engine
  retracted around a multi-bucket push its stream holds nothing else). Not yet done: a refill that
  waits on the consumer's release instead (torch's receiver synchronizes its stream before it
  decrements the share's reference counter), or a fresh buffer per fill with torch's IPC limbo
  (slime's way).
* Never waits forever: a fill waits only for engines' update calls, each under the push's
  deadline, and an engine that fails or misses the deadline leaves (WeightSync calls `leave`
  at once, without awaiting its clean-up), releasing every claim it had; once every engine has
  left, waiting fills end with `PushAbandoned`.
* A failed fill fails the bucket for every engine that asks for it (the same exception).
The slowest engine sets the pace: engines run at most two buckets apart.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable

SLOTS = 2


class PushAbandoned(RuntimeError):
    """Every engine left the push before this bucket was filled."""


class BucketStream:
    """The slots' schedule of one push (see the module docstring).

    buckets: the plan, in order. engines: the urls of the engines that will read it. fill(slot,
    bucket): writes `bucket` into slot `slot` (0 or 1) and returns `entries(tp_size)`; blocking
    fills (shared memory: a memcpy) run in a worker thread (in_thread=True), a CUDA fill that only
    enqueues copies runs on the event loop. resident_bytes: called after each fill, the bytes the
    slots hold now (for `peak_resident_bytes`).
    """

    def __init__(
        self,
        buckets: list,
        engines: Iterable[str],
        fill: Callable[[int, list], Callable[[int], list[str]]],
        *,
        in_thread: bool = False,
        resident_bytes: Callable[[], int] = lambda: 0,
    ) -> None:
        self.buckets, self._fill_slot, self._in_thread = buckets, fill, in_thread
        self._resident_bytes = resident_bytes
        self._answered = {url: 0 for url in engines}  # engine -> buckets answered (0..k-1)
        self._fills: dict[int, asyncio.Future] = {}
        self._waiters: list[asyncio.Future] = []
        self.fill_s = 0.0  # seconds spent filling slots (host time; a CUDA fill only enqueues)
        self.peak_resident_bytes = 0
        self.filled_at_once = 0  # the most slots holding a bucket some engine may still read
        self.providers = [_Provider(self, i) for i in range(len(buckets))]

    # ----- what bucket_send.transfer calls ------------------------------------------------------

    async def entries(self, i: int, tp_size: int) -> list[str]:
        """Bucket i's `serialized_named_tensors` for an engine of `tp_size` ranks, once it is in
        its slot (filled now if no engine asked before). Starts filling bucket i+1 into the other
        slot, so it is ready when this engine's update for i returns. Raises the fill's error, or
        PushAbandoned."""
        filled = self._fill_task(i)
        if i + 1 < len(self.buckets):
            self._fill_task(i + 1)
        entries_of = await asyncio.shield(filled)  # a cancelled engine leaves the fill to others
        return entries_of(tp_size)

    def answered(self, url: str, i: int) -> None:
        """The engine's update call for bucket i returned: it no longer reads bucket i."""
        if url in self._answered:
            self._answered[url] = max(self._answered[url], i + 1)
            self._wake()

    def leave(self, url: str) -> None:
        """The engine is done with this push (every bucket answered, or it failed): it holds no
        claim on any slot any more. Idempotent; an unknown url is ignored."""
        if self._answered.pop(url, None) is not None:
            self._wake()

    def close(self) -> None:
        """Every engine leaves (the push is over); fills still waiting for a slot end."""
        self._answered.clear()
        self._wake()

    # ----- the schedule ----------------------------------------------------------------------------

    def _slot_free_for(self, i: int) -> bool:
        """Slot i % 2 may take bucket i: it is free (i < 2) or every engine answered bucket i-2."""
        return i < SLOTS or all(done >= i - 1 for done in self._answered.values())

    def _fill_task(self, i: int) -> asyncio.Future:
        task = self._fills.get(i)
        if task is None:
            task = self._fills[i] = asyncio.ensure_future(self._fill(i))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read by engines
        return task

    async def _fill(self, i: int) -> Callable[[int], list[str]]:
        while not self._slot_free_for(i):
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter
        if not self._answered:
            raise PushAbandoned(f"every engine left the push before bucket {i}")
        in_use = {j for j, t in self._fills.items() if j != i and t.done() and self._read(j)}
        self.filled_at_once = max(self.filled_at_once, len(in_use) + 1)
        t0 = time.perf_counter()
        if self._in_thread:
            entries_of = await asyncio.to_thread(self._fill_slot, i % SLOTS, self.buckets[i])
        else:
            entries_of = self._fill_slot(i % SLOTS, self.buckets[i])
        self.fill_s += time.perf_counter() - t0
        self.peak_resident_bytes = max(self.peak_resident_bytes, self._resident_bytes())
        return entries_of

    def _read(self, j: int) -> bool:
        """Some engine still in the push may read bucket j (it has not answered it)."""
        return any(done <= j for done in self._answered.values())

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class _Provider:
    """Bucket i of a stream as bucket_send.transfer calls it: `await provider(tp_size)`."""

    def __init__(self, stream: BucketStream, i: int) -> None:
        self.stream, self.index = stream, i

    def __call__(self, tp_size: int):
        return self.stream.entries(self.index, tp_size)
