"""A registry of live services in one Redis hash (`shellrl:engines`, `shellrl:sandboxes`): each
service writes its own registration under its URL every heartbeat, marks it `leaving` when it
drains and deletes it at exit; readers take the live ones. shellrl.clients.engine_registry and
shellrl.clients.sandbox_registry are its two registries.

Liveness is judged on Redis's clock (TIME), so hosts with skewed clocks agree: a registration is
live while `redis_now - heartbeat_at <= ttl_s`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, fields, replace
from typing import Self, TypeVar

import redis.asyncio as aioredis

log = logging.getLogger(__name__)
R = TypeVar("R", bound="Registration")

# HDEL the field only while it still holds this instance's registration (a restarted service on
# the same URL may have registered again in between)
_DELETE_OWN = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if raw and cjson.decode(raw)['instance'] == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


class Registration:
    """What a registration dataclass shares (mixed into frozen dataclasses with at least `url`,
    `instance`, `heartbeat_at` (Redis TIME of the last write, unix seconds) and `ttl_s`)."""

    url: str
    instance: str
    heartbeat_at: float
    ttl_s: float

    def live(self, now: float) -> bool:
        return now - self.heartbeat_at <= self.ttl_s

    def to_json(self) -> str:
        return json.dumps(asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, raw: str | bytes) -> Self:
        """ValueError/TypeError/KeyError for an entry that is no registration; fields this
        version does not know (written by a newer service) are ignored."""
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in data.items() if k in known})


async def redis_now(redis: aioredis.Redis) -> float:
    """Redis's clock, unix seconds (TIME)."""
    seconds, micros = await redis.time()
    return seconds + micros / 1e6


async def write(redis: aioredis.Redis, key: str, registration: Registration) -> None:
    """HSET the registration under its url with heartbeat_at = Redis's clock now."""
    stamped = replace(registration, heartbeat_at=await redis_now(redis))  # type: ignore[type-var]
    await redis.hset(key, registration.url, stamped.to_json())


async def delete(redis: aioredis.Redis, key: str, url: str, instance: str) -> bool:
    """HDEL `url` if it still holds `instance`'s registration; True when deleted."""
    return bool(await redis.eval(_DELETE_OWN, 1, key, url, instance))


async def read_live(redis: aioredis.Redis, key: str, cls: type[R], kind: str) -> dict[str, R]:
    """The live registrations of the hash, url (without a trailing '/') -> registration; dead
    ones and entries that are no registration (logged as `unreadable <kind> registration`) are
    skipped."""
    raw = await redis.hgetall(key)
    now = await redis_now(redis)
    out = {}
    for field, value in raw.items():
        url = (field.decode() if isinstance(field, bytes) else field).rstrip("/")
        try:
            registration = cls.from_json(value)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning(f"unreadable {kind} registration", extra={kind: url, "error": str(exc)})
            continue
        if registration.live(now):
            out[url] = registration
    return out
