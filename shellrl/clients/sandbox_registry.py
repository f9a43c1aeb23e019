"""The sandbox registry in Redis: which sandbox services exist (`shellrl:sandboxes`), written by
the services themselves (services/sandbox/registration.py), read by `SandboxFleet` (the rollout
gateway and the verifier) to add members that joined and stop sending new sessions to members
that are leaving or dead.

    sandbox  HSET shellrl:sandboxes <url> SandboxRegistration   every heartbeat while it serves;
             leaving=true once it drains (SIGTERM); HDEL at exit
    fleet    HGETALL every refresh_s: live and not leaving -> takes new sessions; a member that
             left keeps serving the sessions it owns (they are routed by id) until they end

Liveness is judged on Redis's clock (TIME), as for engines (shellrl.clients.registry).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from shellrl.clients import registry
from shellrl.clients.registry import Registration
from shellrl.streams.keys import SANDBOXES_KEY


@dataclass(frozen=True)
class SandboxRegistration(Registration):
    """One sandbox service's entry. url: where clients reach it; instance: a new id per process
    start; heartbeat_at: Redis TIME of the last write, unix seconds; live for ttl_s after it."""

    url: str
    instance: str
    heartbeat_at: float = 0.0
    ttl_s: float = 6.0
    leaving: bool = False


async def write_registration(redis: aioredis.Redis, registration: SandboxRegistration) -> None:
    """HSET the registration with heartbeat_at = Redis's clock now."""
    await registry.write(redis, SANDBOXES_KEY, registration)


async def delete_registration(redis: aioredis.Redis, url: str, instance: str) -> bool:
    """HDEL `url` if it still holds `instance`'s registration; True when deleted."""
    return await registry.delete(redis, SANDBOXES_KEY, url, instance)


async def read_registrations(redis: aioredis.Redis) -> dict[str, SandboxRegistration]:
    """The live registrations, url -> registration (dead and malformed entries skipped)."""
    return await registry.read_live(redis, SANDBOXES_KEY, SandboxRegistration, "sandbox")
