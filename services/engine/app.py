"""The engine's app: `build_app(settings)` loads the model (parts.py) and serves the SGLang routes
of routes.py and weight_routes.py over it; the lifespan starts and stops the scheduler and, when
`register_url` is set, registers the engine in shellrl:engines (registration.py). On SIGTERM the
engine drains (`EngineRuntime.begin_drain`) within `serve_grace_s`.
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI

from services.engine import routes, weight_routes
from services.engine.bodies import UpdateResult
from services.engine.parts import Parts, build_parts
from services.engine.registration import registered
from services.engine.settings import EngineSettings
from shellrl.service.app import create_app
from shellrl.service.main import Served
from shellrl.service.parts import add_routes, attach


def build_app(settings: EngineSettings) -> Served:
    """Load the model (seconds to minutes) and serve it. Raises what loading the model raises."""
    parts = build_parts(settings)
    runtime = parts.runtime
    return Served(
        create_engine_app(parts),
        on_exit_signal=runtime.on_exit_signal,
        grace_s=runtime.serve_grace_s,
    )


def create_engine_app(parts: Parts) -> FastAPI:
    """The engine's FastAPI app over `parts`; its lifespan starts and stops the scheduler."""
    runtime = parts.runtime

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        runtime.start()
        try:
            async with registered(runtime):  # shellrl:engines while serving (registration.py)
                yield
        finally:
            await asyncio.to_thread(runtime.stop)

    async def ready() -> dict:
        return {
            "ready": runtime.scheduler.alive and not runtime.draining,
            "weight_version": runtime.weight_version,
        }

    app = create_app(
        "engine",
        parts.settings.public_dict(),
        ready_check=ready,
        lifespan=lifespan,
        api_token=parts.settings.api_token_value(),
        openapi_components={"UpdateResult": UpdateResult.model_json_schema()},
    )
    attach(app, parts)
    add_routes(app, routes.router)
    add_routes(app, weight_routes.router)
    return app
