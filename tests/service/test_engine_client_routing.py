"""EngineClient against two real engine processes: least-loaded routing, rotation, fan-out."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_responses import EngineUnavailable
from tests.helpers.engine import running_engine


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("engines")
    contexts = [running_engine(log_dir, SHELLRL_WEIGHT_VERSION="0") for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:  # start both at once
        processes = list(pool.map(lambda c: c.__enter__(), contexts))
    try:
        yield processes
    finally:
        for context in contexts:
            context.__exit__(None, None, None)


async def test_concurrent_requests_spread_over_engines_and_respect_rotation(engines):
    urls = [e.url for e in engines]
    params = {"max_new_tokens": 30, "ignore_eos": True}
    async with EngineClient(urls) as client:
        results = await asyncio.gather(
            *(client.generate([101 + i, 5, 6], params) for i in range(8))
        )
        assert {r.engine_url for r in results} == set(urls)
        assert sorted(r.engine_url for r in results).count(urls[0]) == 4
        client.set_available(urls[0], False)
        results = await asyncio.gather(
            *(client.generate([101 + i, 5, 6], params) for i in range(4))
        )
        assert {r.engine_url for r in results} == {urls[1]}
        client.set_available(urls[0], True)
        pinned = await client.generate([7, 8, 9], {"max_new_tokens": 1}, url=urls[0])
        assert pinned.engine_url == urls[0]


async def test_control_calls_fan_out_to_every_engine(engines):
    urls = [e.url for e in engines]
    async with EngineClient(urls) as client:
        assert await client.get_weight_version() == {u: "0" for u in urls}
        await client.pause_generation("abort")
        await client.continue_generation()
        assert set(await client.flush_cache()) == set(urls)
        assert await client.health_generate() == {u: True for u in urls}


async def test_a_dead_engine_is_reported_unavailable_and_health_is_false(engines):
    dead = "http://127.0.0.1:9"  # discard port: connection refused
    async with EngineClient([dead], connect_retries=1, retry_backoff_s=0.01) as client:
        assert await client.health() == {dead: False}
        with pytest.raises(EngineUnavailable):
            await client.get_model_info()
