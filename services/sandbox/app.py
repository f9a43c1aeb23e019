"""The sandbox's app: `build_app(settings)` builds the parts (parts.py: the start-up checks, the
private mount namespace, the isolation probe, cgroups, the session manager) and serves the routes
of routes.py over them, with the background loops of lifespan.py and, when `register_url` is set,
its registration in shellrl:sandboxes (registration.py).
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI

from services.sandbox import routes
from services.sandbox.lifespan import running
from services.sandbox.parts import Parts, build_parts
from services.sandbox.registration import with_registration
from services.sandbox.settings import SandboxSettings
from shellrl.service.app import create_app
from shellrl.service.parts import add_routes, attach


def build_app(settings: SandboxSettings) -> FastAPI:
    """The sandbox service for `run_service("sandbox", SandboxSettings, build_app)`. SystemExit
    when not run as root; ValueError on settings that cannot work (parts.build_parts)."""
    parts = build_parts(settings)
    app = create_sandbox_app(parts, api_token=settings.api_token_value())
    return with_registration(app, settings)  # shellrl:sandboxes when register_url


def create_sandbox_app(parts: Parts, *, api_token: str | None = None) -> FastAPI:
    """The HTTP API (routes.py) over `parts`: `parts.config` is served at GET /v1/config,
    `parts.ready_details` (plus the live counts and the host's health) at /readyz. Every route
    but the probes needs `api_token` (None: no auth)."""
    manager = parts.manager

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        async with running(parts):
            yield

    async def ready_check() -> dict:
        return {
            "ready": True,
            **parts.ready_details,
            "sessions": len(manager.sessions),
            "headroom": manager.headroom(),
            "warm_pool": parts.warm_pool.status(),
            "health": (await asyncio.to_thread(parts.health.sample)).as_dict(),
        }

    app = create_app(
        "sandbox",
        parts.config,
        ready_check=ready_check,
        lifespan=lifespan,
        api_token=api_token,
        openapi_components=routes.request_schemas(manager, parts.allow_network_policies),
    )
    attach(app, parts)
    add_routes(app, routes.router)
    return app
