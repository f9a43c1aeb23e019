"""Exec slots of the sandbox (services/sandbox/execution/slots.py): fair hand-out, queue time, cancellation.
Pure asyncio with an injected clock; no processes."""

from __future__ import annotations

import asyncio

import pytest

from services.sandbox.execution.slots import FairSlots


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _hold_for(slots: FairSlots, clock: Clock, key: str, seconds: float) -> None:
    async with slots.hold(key):
        clock.now += seconds


async def test_a_free_slot_goes_to_the_waiting_session_that_held_slots_the_least():
    clock = Clock()
    slots = FairSlots(1, half_life_s=60.0, clock=clock)
    await _hold_for(slots, clock, "hog", 30.0)  # 30 slot-seconds
    await _hold_for(slots, clock, "busy", 5.0)
    order: list[str] = []
    release = asyncio.Event()

    async def take(key: str) -> None:
        async with slots.hold(key):
            order.append(key)
            if key == "holder":
                await release.wait()

    holder = asyncio.create_task(take("holder"))
    await asyncio.sleep(0)
    waiters = [asyncio.create_task(take(k)) for k in ("hog", "busy", "light")]  # arrival order
    await asyncio.sleep(0)
    assert slots.waiting == 3
    release.set()
    await asyncio.gather(holder, *waiters)
    assert order == ["holder", "light", "busy", "hog"]  # FIFO would be holder, hog, busy, light


async def test_equal_usage_is_served_in_arrival_order_and_usage_decays():
    clock = Clock()
    slots = FairSlots(1, half_life_s=10.0, clock=clock)
    await _hold_for(slots, clock, "a", 8.0)
    assert slots.usage_s("a") == pytest.approx(8.0)
    clock.now += 10.0
    assert slots.usage_s("a") == pytest.approx(4.0)  # one half-life later
    order: list[str] = []

    async def take(key: str) -> None:
        async with slots.hold(key):
            order.append(key)
            await asyncio.sleep(0)

    await asyncio.gather(*(take(k) for k in ("x", "y", "z")))
    assert order == ["x", "y", "z"]
    slots.forget("a")
    assert slots.usage_s("a") == 0.0


async def test_hold_yields_the_seconds_waited_for_the_slot():
    clock = Clock()
    slots = FairSlots(1, clock=clock)
    waited: dict[str, float] = {}

    async def take(key: str, hold_s: float) -> None:
        async with slots.hold(key) as queue_s:
            waited[key] = queue_s
            await asyncio.sleep(0)  # the other one queues meanwhile
            clock.now += hold_s

    await asyncio.gather(take("first", 2.5), take("second", 0.0))
    assert waited == {"first": 0.0, "second": 2.5}


async def test_cancelling_a_waiter_gives_up_its_place_and_a_granted_slot_is_passed_on():
    slots = FairSlots(1)
    got: list[str] = []

    async def take(key: str) -> None:
        async with slots.hold(key):
            got.append(key)

    holder = slots.hold("holder")
    await holder.__aenter__()
    gone, late, last = (asyncio.create_task(take(k)) for k in ("gone", "late", "last"))
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    assert slots.waiting == 2
    await holder.__aexit__(None, None, None)  # hands the slot to "late" ...
    late.cancel()  # ... which is cancelled before it runs: "last" gets the slot
    await asyncio.gather(gone, late, return_exceptions=True)
    await last
    assert got == ["last"] and slots.running == 0 and slots.waiting == 0
