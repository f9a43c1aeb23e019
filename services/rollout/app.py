"""The rollout gateway's app: at start-up the lifespan builds the parts (parts.py), attaches them
for the routes (routes.py, evaluation_routes.py, run_routes.py) and runs the background tasks
(lifespan.py) until shutdown.
"""

from __future__ import annotations

import contextlib

from fastapi import FastAPI

from services.rollout import evaluation_routes, routes, run_routes
from services.rollout.lifespan import running
from services.rollout.parts import Parts, build_parts
from services.rollout.settings import RolloutSettings
from shellrl.service.app import create_app
from shellrl.service.parts import add_routes, attach, attached


def build_app(settings: RolloutSettings) -> FastAPI:
    """The gateway's FastAPI app over `settings` (its parts are built when it starts)."""
    api_token = settings.api_token_value()  # required by this app, sent to engine/sandbox/verifier

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        parts = build_parts(settings, api_token)
        attach(app, parts)
        async with running(parts):
            yield

    async def ready_check() -> dict:
        parts: Parts | None = attached(app)
        if parts is None:
            return {"ready": False, "reason": "starting"}
        await parts.redis.ping()
        return {
            "ready": True,
            "redis": True,
            "infra_down": sorted(parts.gate.down),
            "worker_enabled": settings.worker_enabled,
        }

    app = create_app("rollout", settings.public_dict(), ready_check, lifespan, api_token=api_token)
    add_routes(app, routes.router)
    add_routes(app, evaluation_routes.router)
    add_routes(app, run_routes.router)
    return app
