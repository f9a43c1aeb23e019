"""The sandbox service's entry in the registry `shellrl:sandboxes` (shellrl.clients.sandbox_registry):
with `register_url` set, written once the service answers its own /readyz, again every
`register_heartbeat_s` (live for HEARTBEATS_LIVE of them), deleted at shutdown (before its sessions
are), so rollout gateways and verifiers running a `SandboxFleet` over the registry add it as it
joins and send it no new session once it goes. Redis errors are logged and retried at the next
beat: the entry lapses after its ttl, the service keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

import httpx
import redis.asyncio as aioredis

from shellrl import streams
from shellrl.clients.sandbox_registry import (
    SandboxRegistration,
    delete_registration,
    write_registration,
)

log = logging.getLogger(__name__)
HEARTBEATS_LIVE = 3
NOT_SERVING_POLL_S = 0.2


class SandboxRegistrar:
    """Registers `url` while the service at `local_url` answers /readyz (module docstring)."""

    def __init__(
        self, redis: aioredis.Redis, url: str, local_url: str, *, heartbeat_s: float
    ) -> None:
        self.redis, self.url, self.local_url = redis, url.rstrip("/"), local_url
        self.heartbeat_s = heartbeat_s
        self.instance = uuid.uuid4().hex[:12]
        self.registered = False

    async def run(self) -> None:
        """Heartbeat until cancelled."""
        async with httpx.AsyncClient(timeout=5.0) as http:
            while not self.registered:  # not before the service answers
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{self.local_url}/readyz")).status_code == 200:
                        break
                await asyncio.sleep(NOT_SERVING_POLL_S)
        while True:
            try:
                await write_registration(
                    self.redis,
                    SandboxRegistration(
                        self.url, self.instance, ttl_s=HEARTBEATS_LIVE * self.heartbeat_s
                    ),
                )
                if not self.registered:
                    log.info(
                        "registered in shellrl:sandboxes",
                        extra={"sandbox": self.url, "instance": self.instance},
                    )
                self.registered = True
            except Exception as exc:  # Redis away: the entry lapses after its ttl
                log.warning("sandbox registration failed", extra={"error": str(exc)})
            await asyncio.sleep(self.heartbeat_s)

    async def close(self) -> None:
        """Delete this instance's registration (bounded; errors logged)."""
        try:
            await asyncio.wait_for(delete_registration(self.redis, self.url, self.instance), 5.0)
        except Exception as exc:  # shutting down: Redis away or slow; the entry lapses (ttl)
            log.warning("could not delete the sandbox registration", extra={"error": str(exc)})


def with_registration(app, settings):
    """`app` (the sandbox's FastAPI app) registering itself while it serves when
    `settings.register_url` is set; unchanged otherwise."""
    if not settings.register_url:
        return app
    inner = app.router.lifespan_context
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    local_url = f"http://{host}:{settings.listen_port}"

    @contextlib.asynccontextmanager
    async def lifespan(app_):
        redis = streams.connect(settings.redis_url)
        registrar = SandboxRegistrar(
            redis, settings.register_url, local_url, heartbeat_s=settings.register_heartbeat_s
        )
        try:
            async with inner(app_) as state:
                task = asyncio.create_task(registrar.run(), name="sandbox-registration")
                try:
                    yield state
                finally:  # unregistered before the sessions go (inner's exit deletes them)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    await registrar.close()
        finally:
            await redis.aclose()

    app.router.lifespan_context = lifespan
    return app
