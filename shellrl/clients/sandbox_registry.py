"""The sandbox registry in Redis: which sandbox services exist (`shellrl:sandboxes`), written by
the services themselves (services/sandbox/registration.py), read by `SandboxFleet` (the rollout
gateway and the verifier) to add members that joined and stop sending new sessions to members
that are leaving or dead.

    sandbox  HSET shellrl:sandboxes <url> SandboxRegistration   every heartbeat while it serves;
             leaving=true once it drains (SIGTERM); HDEL at exit
    fleet    HGETALL every refresh_s: live and not leaving -> takes new sessions; a member that
             left keeps serving the sessions it owns (they are routed by id) until they end

Liveness is judged on Redis's clock (TIME), as for engines (shellrl.clients.engine_registry): a
registration is live while `redis_now - heartbeat_at <= ttl_s`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, fields, replace

import redis.asyncio as aioredis

from shellrl.clients.engine_registry import redis_now
from shellrl.streams.keys import SANDBOXES_KEY

log = logging.getLogger(__name__)

# HDEL the field only while it still holds this instance's registration (a restarted service on
# the same URL may have registered again in between)
_DELETE_OWN = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if raw and cjson.decode(raw)['instance'] == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""


@dataclass(frozen=True)
class SandboxRegistration:
    """One sandbox service's entry. url: where clients reach it; instance: a new id per process
    start; heartbeat_at: Redis TIME of the last write, unix seconds; live for ttl_s after it."""

    url: str
    instance: str
    heartbeat_at: float = 0.0
    ttl_s: float = 6.0
    leaving: bool = False

    def live(self, now: float) -> bool:
        return now - self.heartbeat_at <= self.ttl_s

    @classmethod
    def from_json(cls, raw: str | bytes) -> SandboxRegistration:
        """ValueError/TypeError/KeyError for an entry that is no registration."""
        data = json.loads(raw)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


async def write_registration(redis: aioredis.Redis, registration: SandboxRegistration) -> None:
    """HSET the registration with heartbeat_at = Redis's clock now."""
    stamped = replace(registration, heartbeat_at=await redis_now(redis))
    await redis.hset(SANDBOXES_KEY, registration.url, json.dumps(asdict(stamped)))


async def delete_registration(redis: aioredis.Redis, url: str, instance: str) -> bool:
    """HDEL `url` if it still holds `instance`'s registration; True when deleted."""
    return bool(await redis.eval(_DELETE_OWN, 1, SANDBOXES_KEY, url, instance))


async def read_registrations(redis: aioredis.Redis) -> dict[str, SandboxRegistration]:
    """The live registrations, url -> registration (dead and malformed entries skipped)."""
    raw = await redis.hgetall(SANDBOXES_KEY)
    now = await redis_now(redis)
    out = {}
    for key, value in raw.items():
        url = (key.decode() if isinstance(key, bytes) else key).rstrip("/")
        try:
            registration = SandboxRegistration.from_json(value)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning(
                "unreadable sandbox registration", extra={"sandbox": url, "error": str(exc)}
            )
            continue
        if registration.live(now):
            out[url] = registration
    return out
