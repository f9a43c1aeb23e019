"""What the consumer groups of a stream have delivered and acknowledged (XINFO GROUPS, XPENDING),
and the housekeeping that must respect it: the backlog of a group (backpressure,
`StreamProducer.wait_for_backlog_below`), trimming acknowledged history
(`StreamProducer.trim_acknowledged`) and deleting idle consumers
(`StreamConsumer.delete_idle_consumers`).
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shellrl.streams.entry import _id_key, _next_id, _s
from shellrl.streams.metrics import TRIMMED

# KEYS[1] stream; ARGV[1] group, ARGV[2] min idle ms. Deletes consumers of the group that have no
# pending entries and were idle at least ARGV[2] ms; returns their names. Atomic, so a consumer
# cannot receive an entry between the check and the delete.
_DELETE_IDLE_CONSUMERS_SCRIPT = """
local deleted = {}
for _, info in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local c = {}
  for i = 1, #info, 2 do c[info[i]] = info[i + 1] end
  if tonumber(c['pending']) == 0 and tonumber(c['idle']) >= tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], c['name'])
    deleted[#deleted + 1] = c['name']
  end
end
return deleted
"""


async def backlog(redis: aioredis.Redis, stream: str, group: str) -> int:
    """Entries of `stream` that `group` has not acknowledged: pending + not yet delivered."""
    for info in await group_infos(redis, stream):
        if info["name"] == group:
            lag = info.get("lag")
            if lag is None:  # Redis cannot tell after XDEL in the middle: count from the stream
                lag = await undelivered(redis, stream, info["last-delivered-id"])
            return int(info["pending"]) + int(lag)
    return int(await redis.xlen(stream))  # group not created yet: everything is backlog


async def trim_acknowledged(redis: aioredis.Redis, stream: str, maxlen: int) -> int:
    """If XLEN > maxlen, drop entries that every group has delivered and acknowledged.

    Never removes an entry that is pending or undelivered in any group; a stream without
    groups is never trimmed. XTRIM MINID ~ trims whole radix-tree nodes only, so it may keep
    some acknowledged entries, never the reverse. Returns the number of entries removed.
    """
    length = int(await redis.xlen(stream))
    if length <= maxlen:
        return 0
    groups = await group_infos(redis, stream)
    if not groups:
        return 0
    async with redis.pipeline(transaction=False) as pipe:
        for info in groups:
            pipe.xpending(stream, info["name"])
        summaries = await pipe.execute()
    bounds = []
    for info, summary in zip(groups, summaries):
        bound = _next_id(_s(info["last-delivered-id"]))
        if summary["pending"]:
            bound = min(bound, _s(summary["min"]), key=_id_key)
        bounds.append(bound)
    threshold = min(bounds, key=_id_key)
    removed = int(await redis.xtrim(stream, minid=threshold, approximate=True))
    if removed:
        TRIMMED.labels(stream).inc(removed)
    return removed


async def delete_idle_consumers(
    redis: aioredis.Redis, stream: str, group: str, min_idle_ms: int
) -> list[str]:
    """Remove consumers of `group` idle >= `min_idle_ms` that hold no pending entries.

    A consumer with pending entries is never deleted (DELCONSUMER would drop its entries;
    known_pitfalls C30): re-claim them first. Returns the deleted consumer names.
    """
    script = redis.register_script(_DELETE_IDLE_CONSUMERS_SCRIPT)
    try:
        names = await script(keys=[stream], args=[group, int(min_idle_ms)])
    except ResponseError as exc:
        if "no such key" in str(exc).lower() or "NOGROUP" in str(exc):
            return []
        raise
    return [_s(n) for n in names]


async def group_infos(redis: aioredis.Redis, stream: str) -> list[dict]:
    """XINFO GROUPS of `stream` with str keys and names ([] when the stream does not exist)."""
    try:
        raw = await redis.xinfo_groups(stream)
    except ResponseError:  # no such key
        return []
    out = []
    for info in raw:
        info = {_s(k): v for k, v in info.items()}
        info["name"] = _s(info["name"])
        out.append(info)
    return out


async def undelivered(redis: aioredis.Redis, stream: str, last_delivered) -> int:
    """Entries after `last_delivered`, counted in pages (only when XINFO's lag is unknown)."""
    count, start = 0, f"({_s(last_delivered)}"
    while True:
        page = await redis.xrange(stream, min=start, max="+", count=1000)
        count += len(page)
        if len(page) < 1000:
            return count
        start = f"({_s(page[-1][0])}"
