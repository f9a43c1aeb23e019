"""The learner's app: at start-up the lifespan builds the parts (parts.py: loads the model, in a
thread), attaches them for the routes (routes.py: status, checkpoints, pause, resume, kl) and runs
the training loop (lifespan.py) until shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import FastAPI

from services.learner import routes
from services.learner.lifespan import running
from services.learner.parts import Parts, build_parts
from services.learner.settings import LearnerSettings
from shellrl.service.app import create_app
from shellrl.service.parts import add_routes, attach, attached


def build_app(settings: LearnerSettings) -> FastAPI:
    """The learner's FastAPI app over `settings` (its parts are built when it starts)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        parts = await asyncio.to_thread(build_parts, settings)
        attach(app, parts)
        async with running(parts):
            yield

    async def ready_check() -> dict:
        parts: Parts | None = attached(app)
        task = parts.worker_task if parts is not None else None
        if parts is None or task is None or task.done():
            return {"ready": False, "reason": "worker not running"}
        if not parts.worker.resumed.is_set():  # the checkpoint's weights not yet pushed
            return {"ready": False, "reason": "resuming", "version": parts.worker.version}
        return {"ready": bool(await parts.redis.ping()), "version": parts.worker.version}

    app = create_app(
        "learner",
        settings.public_dict(),
        ready_check,
        lifespan,
        api_token=settings.api_token_value(),
    )
    add_routes(app, routes.router)
    return app
