"""Several Lua script calls in one pipelined round trip (shellrl/streams/script_batch.py), on a
real redis-server: replies in order, a call's own error in its place, a flushed script cache
re-sends only the calls it refused, and no SCRIPT EXISTS round trip; group commit puts the calls
of one linger in one round trip."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from shellrl.streams import connect
from shellrl.streams.script_batch import GroupCommit, ScriptCall, run_scripts
from tests.helpers.redis_server import RedisServer

_INCR = "return redis.call('INCRBY', KEYS[1], ARGV[1])"
_SADD = "return redis.call('SADD', KEYS[1], ARGV[1])"


@pytest.fixture
async def redis(redis_server):
    client = connect(redis_server.url)
    yield client
    await client.aclose()


async def _commands(redis) -> dict[str, int]:
    stats = await redis.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


async def test_replies_come_in_order_and_a_call_error_costs_only_its_own_call(redis):
    incr, sadd = redis.register_script(_INCR), redis.register_script(_SADD)
    await redis.set("a-string", "x")
    replies = await run_scripts(
        redis,
        [
            ScriptCall(incr, ["n"], [2]),
            ScriptCall(sadd, ["a-string"], ["m"]),  # WRONGTYPE: the script raises
            ScriptCall(sadd, ["s"], ["m"]),
            ScriptCall(incr, ["n"], [3]),
        ],
    )
    assert replies[0] == 2 and replies[2] == 1 and replies[3] == 5
    assert isinstance(replies[1], ResponseError) and "WRONGTYPE" in str(replies[1])
    assert await redis.get("n") == b"5" and await redis.smembers("s") == {b"m"}
    assert await run_scripts(redis, []) == []


async def test_a_flushed_script_cache_resends_only_the_refused_calls_and_never_asks_exists(redis):
    incr, sadd = redis.register_script(_INCR), redis.register_script(_SADD)
    await redis.script_flush()
    await redis.script_load(_INCR)  # loaded again; SADD's script is gone
    await redis.config_resetstat()
    replies = await run_scripts(
        redis,
        [
            ScriptCall(incr, ["n"], [1]),
            ScriptCall(sadd, ["s"], ["m"]),
            ScriptCall(incr, ["n"], [1]),
        ],
    )
    assert replies == [1, 1, 2]
    assert await redis.get("n") == b"2"  # each INCRBY ran exactly once
    calls = await _commands(redis)
    assert calls["evalsha"] == 4  # three, and the refused one again
    assert calls["script|load"] == 1
    assert "script|exists" not in calls  # redis-py's pipelined Script would ask every time


class _PipelineCount:
    """Counts the pipelines a client opens (a spy on the real client's method; nothing faked)."""

    def __init__(self, redis) -> None:
        self.count, self._real = 0, redis.pipeline
        redis.pipeline = self

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self._real(*args, **kwargs)


async def test_group_commit_sends_the_calls_of_one_linger_in_one_round_trip(redis):
    incr, sadd = redis.register_script(_INCR), redis.register_script(_SADD)
    await redis.set("a-string", "x")
    for script in (_INCR, _SADD):
        await redis.script_load(script)  # else the first batch takes a second trip (NOSCRIPT)
    commits = GroupCommit(redis, linger_s=0.2)
    pipelines = _PipelineCount(redis)
    calls = [commits.call(ScriptCall(incr, ["n"], [1])) for _ in range(20)]
    calls.append(commits.call(ScriptCall(sadd, ["a-string"], ["m"])))
    replies = await asyncio.gather(*calls, return_exceptions=True)
    assert sorted(replies[:20]) == list(range(1, 21))
    assert isinstance(replies[20], ResponseError)  # its own error, raised in its caller only
    assert pipelines.count == 1
    assert await commits.call(ScriptCall(incr, ["n"], [1])) == 21  # a later call: the next batch
    assert pipelines.count == 2


async def test_group_commit_tells_every_caller_when_redis_is_away_and_skips_a_cancelled_one(
    tmp_path,
):
    server = RedisServer(tmp_path / "r").start()
    client = connect(server.url)
    try:
        incr = client.register_script(_INCR)
        commits = GroupCommit(client, linger_s=0.3)
        cancelled = asyncio.ensure_future(commits.call(ScriptCall(incr, ["n"], [1])))
        kept = asyncio.ensure_future(commits.call(ScriptCall(incr, ["n"], [1])))
        await asyncio.sleep(0)
        cancelled.cancel()
        assert await kept == 2  # a cancelled caller does not withdraw its call: it ran first
        assert await client.get("n") == b"2"
        server.stop()
        outcomes = await asyncio.gather(
            *(commits.call(ScriptCall(incr, ["n"], [1])) for _ in range(3)), return_exceptions=True
        )
        assert all(isinstance(o, (RedisConnectionError, OSError)) for o in outcomes), outcomes
    finally:
        await client.aclose()
        server.stop()
