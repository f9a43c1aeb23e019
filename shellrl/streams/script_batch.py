"""Several Lua script calls in one round trip: the per-entry bookkeeping of a batch of entries.

A consumer that counts each entry it reads with a script or two (the gateway's task statistics
and group accounting, services/rollout/stats.py) pays the server one request an entry: a read
and a write on the socket, an event-loop turn, for a few microseconds of work. `run_scripts`
sends a batch's calls as one pipeline of EVALSHA (no MULTI: each call stays atomic on its own, as
it was alone), so the batch costs one request.

Not redis-py's pipelined `Script` calls: its pipeline sends `SCRIPT EXISTS` before every execute
that holds a registered script (redis/asyncio/client.py, `Pipeline.load_scripts`), one more round
trip each time. Here the EVALSHAs go as plain commands, and only the calls answered NOSCRIPT (a
restarted or flushed Redis lost its script cache) are sent again after `SCRIPT LOAD`.

`GroupCommit` batches calls that come one at a time from many coroutines (the gateway's episode
counters, one call an episode): those arriving within `linger_s` of the first share a batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError


@dataclass(frozen=True)
class ScriptCall:
    """One call of a registered script (`redis.register_script`) with its KEYS and ARGV."""

    script: AsyncScript
    keys: Sequence[str]
    args: Sequence[Any]


async def run_scripts(redis: aioredis.Redis, calls: Sequence[ScriptCall]) -> list[Any]:
    """Run `calls` in one pipelined round trip (two when the server lacks a script). Returns one
    reply per call, in order; a call's own error (the script raised, or a WRONGTYPE key) is
    returned in its place as the `redis.exceptions.ResponseError` instance, not raised, so that
    it costs only its own entry. Connection errors and timeouts raise; which calls ran is then
    unknown, so a caller that retries the batch must send idempotent scripts (the stats
    consumer's are, by trajectory id; `GroupCommit` does not retry: its callers get the error)."""
    if not calls:
        return []
    replies = await _pipelined(redis, calls)
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        for script in {id(calls[i].script): calls[i].script for i in missing}.values():
            await redis.script_load(script.script)
        again = await _pipelined(redis, [calls[i] for i in missing])
        for i, reply in zip(missing, again):
            replies[i] = reply
    return replies


async def _pipelined(redis: aioredis.Redis, calls: Sequence[ScriptCall]) -> list[Any]:
    async with redis.pipeline(transaction=False) as pipe:
        for call in calls:
            pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
        return list(await pipe.execute(raise_on_error=False))


class GroupCommit:
    """Script calls that arrive within `linger_s` of the first one go to Redis together, as one
    `run_scripts` batch (one round trip for all of them). `call` returns once its own call ran,
    with its reply, or raises its own error or the batch's (a connection error: then which calls
    of the batch ran is unknown, as for any lost reply). Each caller waits `linger_s` (seconds)
    more at most; under load the calls of many callers share one request. A caller cancelled
    while it waits does not withdraw its call: the batch runs it all the same. Calls run in
    the order they came within a batch; two batches may overlap (a new one gathers while the
    last is in flight, on another connection), so calls whose order matters across batches
    must commute (increments do: the final values are the same in either order)."""

    def __init__(self, redis: aioredis.Redis, linger_s: float) -> None:
        if linger_s < 0:
            raise ValueError(f"linger_s must be >= 0; got {linger_s}")
        self.redis, self.linger_s = redis, linger_s
        self._waiting: list[tuple[ScriptCall, asyncio.Future]] = []
        self._flush: asyncio.Task | None = None  # the batch that is gathering calls
        self._flushing: set[asyncio.Task] = set()  # every flush until it is done (strong refs)

    async def call(self, call: ScriptCall) -> Any:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((call, future))
        if self._flush is None:
            self._flush = asyncio.create_task(self._flush_after_linger())
            self._flushing.add(self._flush)
            self._flush.add_done_callback(self._flushing.discard)
        return await future

    async def _flush_after_linger(self) -> None:
        try:
            await asyncio.sleep(self.linger_s)
        except asyncio.CancelledError:  # the loop is closing: nobody waits for a reply
            for _, future in self._take():
                future.cancel()
            raise
        batch = self._take()
        try:
            replies = await run_scripts(self.redis, [call for call, _ in batch])
        except asyncio.CancelledError:
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # Redis away or the like: every caller of the batch learns it
            replies = [exc] * len(batch)
        for (_, future), reply in zip(batch, replies):
            if future.done():  # its caller was cancelled
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    def _take(self) -> list[tuple[ScriptCall, asyncio.Future]]:
        batch, self._waiting, self._flush = self._waiting, [], None
        return batch
