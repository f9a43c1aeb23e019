"""bench_push_under_load's wait for an idle engine had no deadline: an engine whose requests never
finish hung the benchmark (and its quick form until the test's 480 s limit)."""

from __future__ import annotations

import asyncio
import time

import pytest

from benchmarks.bench_push_under_load import Load


class StuckEngine:
    """Fault-injecting fake of EngineClient.get_server_info: one request runs forever."""

    async def get_server_info(self) -> dict:
        state = {"num_running_reqs": 1, "num_waiting_reqs": 0}
        return {"http://engine": {"internal_states": [state]}}


class IdleEngine(StuckEngine):
    async def get_server_info(self) -> dict:
        state = {"num_running_reqs": 0, "num_waiting_reqs": 0}
        return {"http://engine": {"internal_states": [state]}}


def _idle(client, deadline_s: float) -> float:
    async def go() -> float:
        load = Load(client, streams=0, prompt_tokens=4, new_tokens=4)
        start = time.monotonic()
        try:
            await load.idle(deadline_s)
        finally:
            load.close()
        return time.monotonic() - start

    return asyncio.run(go())


def test_an_engine_that_never_idles_raises_after_the_deadline():
    with pytest.raises(TimeoutError, match="after 0.3 s"):
        _idle(StuckEngine(), 0.3)


def test_an_idle_engine_returns_at_once():
    assert _idle(IdleEngine(), 300) < 5
