"""The verifier's app: at start-up the lifespan builds the parts (parts.py), attaches them for the
routes (routes.py: `POST /v1/verify`, `GET /v1/checks`) and runs the stream worker (lifespan.py)
until shutdown.
"""

from __future__ import annotations

import contextlib

from fastapi import FastAPI

from services.verifier import routes
from services.verifier.checks import VERIFIER_VERSION
from services.verifier.lifespan import running
from services.verifier.parts import Parts, build_parts
from services.verifier.settings import VerifierSettings
from shellrl.contract.task_schema import task_schema_components
from shellrl.service.app import create_app
from shellrl.service.openapi import REF
from shellrl.service.parts import add_routes, attach, attached


def build_app(settings: VerifierSettings) -> FastAPI:
    """The verifier's FastAPI app over `settings` (its parts are built when it starts)."""
    api_token = settings.api_token_value()  # required by this app and sent to the sandbox

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        parts = build_parts(settings, api_token)
        attach(app, parts)
        async with running(parts):
            yield

    async def ready_check() -> dict:
        parts: Parts | None = attached(app)
        if parts is None:
            return {"ready": False, "reason": "starting", "verifier_version": VERIFIER_VERSION}
        details: dict = {"verifier_version": VERIFIER_VERSION}
        details["sandbox"] = bool((await parts.sandbox.ready())["ready"])
        if settings.worker_enabled and parts.redis is not None:
            details["redis"] = bool(await parts.redis.ping())
        details["ready"] = details["sandbox"] and details.get("redis", True)
        return details

    app = create_app(
        "verifier",
        settings.public_dict(),
        ready_check,
        lifespan,
        api_token=api_token,
        openapi_components=task_schema_components(REF),
    )
    add_routes(app, routes.router)
    return app
