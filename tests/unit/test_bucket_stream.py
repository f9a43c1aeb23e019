"""The slot schedule of a streamed push (services/learner/weights/bucket_stream.py) as engine_load's
`transfer` (bucket_send.py) drives it: engines of different speeds, an engine that fails or freezes mid-push, at
most two slots filled at once, and no slot rewritten while an engine's update on it is in
flight (tests/fakes/slow_bucket_engines.py reads each slot at the start and the end of a call)."""

from __future__ import annotations

import asyncio

import pytest

from services.learner.weights.bucket_send import transfer
from services.learner.weights.bucket_stream import SLOTS, BucketStream, PushAbandoned
from shellrl.clients.engine_responses import EngineError
from tests.fakes.slow_bucket_engines import SlowBucketEngines

BUCKETS = 7
GUARD_S = 10.0  # a hang guard: every push here takes well under a second


class SlotRecorder:
    """The fill function of a stream: writes the bucket index into its slot, and records how many
    slots held a bucket some engine had not answered yet when a fill happened."""

    def __init__(self) -> None:
        self.slots: list = [None] * SLOTS
        self.fills: list[tuple[int, int]] = []  # (slot, bucket) in fill order
        self.stream: BucketStream | None = None

    def fill(self, slot: int, bucket: list):
        (index,) = bucket
        self.slots[slot] = index
        self.fills.append((slot, index))
        return lambda tp_size: [f"{slot}:{index}"] * tp_size


def stream_of(urls: list[str]) -> tuple[BucketStream, SlotRecorder]:
    recorder = SlotRecorder()
    stream = BucketStream([[i] for i in range(BUCKETS)], urls, recorder.fill)
    recorder.stream = stream
    return stream, recorder


async def until(condition, timeout_s: float = GUARD_S) -> None:
    """Yield to the loop (and the fills' threads) until `condition()` holds; TimeoutError after
    `timeout_s`. A fixed sleep was too short on a loaded CI machine (ciD at 249758f: "ok" had
    received nothing after 0.1 s)."""

    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.002)

    await asyncio.wait_for(poll(), timeout_s)


async def push(stream: BucketStream, engines: SlowBucketEngines, urls: list[str]) -> list:
    """Every engine's transfer at once, as WeightSync runs them; `transfer` itself leaves the
    stream when its engine is done or fails (WeightSync leaves again after the call: idempotent)."""
    prepared = {"buckets": stream.providers, "stream": stream}
    return await asyncio.wait_for(
        asyncio.gather(
            *(transfer(engines, None, u, prepared, "5", 1) for u in urls),
            return_exceptions=True,
        ),
        GUARD_S,
    )


async def test_two_engines_one_slow_each_get_every_bucket_in_order_and_no_slot_is_torn():
    urls = ["fast", "slow"]
    stream, recorder = stream_of(urls)
    engines = SlowBucketEngines(recorder.slots, {"fast": 0.001, "slow": 0.03})
    outcomes = await push(stream, engines, urls)
    assert outcomes == [None, None]
    assert engines.received == {u: list(range(BUCKETS)) for u in urls}
    assert engines.labels["fast"] == [None] * (BUCKETS - 1) + ["5"]  # the version with the last
    assert engines.torn == []
    assert [b for _, b in recorder.fills] == list(range(BUCKETS))  # each bucket filled once
    assert all(slot == b % SLOTS for slot, b in recorder.fills)
    assert stream.filled_at_once <= 2


async def test_a_slot_is_refilled_only_after_every_engine_answered_its_bucket():
    urls = ["a", "b", "c"]
    stream, recorder = stream_of(urls)
    engines = SlowBucketEngines(recorder.slots, {"a": 0.0, "b": 0.02, "c": 0.005})
    seen_in_flight: list[tuple[int, set]] = []
    original = recorder.fill

    def fill(slot, bucket):  # what was being read when a slot was rewritten
        seen_in_flight.append((bucket[0], set(engines.outstanding)))
        return original(slot, bucket)

    stream._fill_slot = fill
    assert await push(stream, engines, urls) == [None, None, None]
    for index, in_flight in seen_in_flight:
        if index >= SLOTS:
            assert not any(b == index - SLOTS for _, b in in_flight), (index, in_flight)
    assert engines.torn == [] and stream.filled_at_once <= 2


async def test_an_engine_failing_mid_push_leaves_and_the_others_finish():
    urls = ["ok", "failing"]
    stream, recorder = stream_of(urls)
    engines = SlowBucketEngines(
        recorder.slots, {"ok": 0.005, "failing": 0.02}, fail_at={"failing": 2}
    )
    outcomes = await push(stream, engines, urls)
    assert outcomes[0] is None and isinstance(outcomes[1], EngineError)
    assert engines.received["ok"] == list(range(BUCKETS))
    assert engines.received["failing"] == [0, 1]
    assert engines.torn == []


async def test_a_frozen_engine_holds_the_others_only_until_it_leaves_at_its_deadline():
    urls = ["ok", "frozen"]
    stream, recorder = stream_of(urls)
    engines = SlowBucketEngines(recorder.slots, {"ok": 0.0, "frozen": 0.0}, hang_at={"frozen": 1})
    prepared = {"buckets": stream.providers, "stream": stream}
    ok = asyncio.ensure_future(transfer(engines, None, "ok", prepared, "5", 1))
    frozen = asyncio.ensure_future(transfer(engines, None, "frozen", prepared, "5", 1))
    # "ok" answers buckets 0 and 1 and waits: slot 1 holds bucket 1, which "frozen" still reads
    await until(lambda: len(engines.received["ok"]) >= 3)
    await asyncio.sleep(0.05)  # and it gets no further while "frozen" holds slot 1
    assert engines.received["ok"] == [0, 1, 2] and not ok.done()
    frozen.cancel()  # what WeightSync does at the deadline: cancelled, and it leaves
    stream.leave("frozen")
    await asyncio.wait_for(ok, GUARD_S)
    assert engines.received["ok"] == list(range(BUCKETS)) and engines.torn == []


async def test_when_every_engine_left_a_waiting_fill_ends_and_nothing_stays_pending():
    urls = ["a"]
    stream, recorder = stream_of(urls)
    engines = SlowBucketEngines(recorder.slots, {"a": 0.0}, hang_at={"a": 0})
    prepared = {"buckets": stream.providers, "stream": stream}
    task = asyncio.ensure_future(transfer(engines, None, "a", prepared, "5", 1))
    await until(lambda: 1 in stream._fills and stream._fills[1].done())
    waiting_fill = stream._fills[1]  # prefetched into the other slot: done, it was free
    assert waiting_fill.done()
    third = stream._fill_task(2)  # would need "a" to answer bucket 0
    await asyncio.sleep(0.01)
    assert not third.done()
    task.cancel()
    stream.close()  # the push is over
    with pytest.raises(PushAbandoned):
        await asyncio.wait_for(third, GUARD_S)
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_fill_that_fails_fails_that_bucket_for_every_engine():
    urls = ["a", "b"]

    def broken(slot, bucket):
        if bucket[0] == 3:
            raise RuntimeError("CUDA out of memory (injected)")
        return lambda tp_size: [f"{slot}:{bucket[0]}"]

    stream = BucketStream([[i] for i in range(BUCKETS)], urls, broken)
    slots = [None] * SLOTS

    def recording(slot, bucket):
        slots[slot] = bucket[0]
        return broken(slot, bucket)

    stream._fill_slot = recording
    engines = SlowBucketEngines(slots, {"a": 0.0, "b": 0.01})
    outcomes = await push(stream, engines, urls)
    assert all(isinstance(o, RuntimeError) and "injected" in str(o) for o in outcomes)
    assert engines.received == {"a": [0, 1, 2], "b": [0, 1, 2]}
