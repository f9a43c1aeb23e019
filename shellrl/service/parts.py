"""How a service's routes reach its parts (DESIGN.md: parts.py is each service's composition root).

A service's `build_parts(settings)` returns a typed `Parts` dataclass; its app attaches it once
(`attach(app, parts)`, in the lifespan) and its routes take it as a FastAPI dependency:

    PartsDep = Annotated[Parts, Depends(parts_dependency(Parts))]

    @router.get("/v1/things/{thing_id}")
    async def get_thing(thing_id: str, parts: PartsDep) -> dict: ...

The dependency reads only the request, so it adds nothing to the OpenAPI schema. Before the
lifespan has attached the parts (a request during start-up), it answers 503 `starting`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request

from shellrl.service.app import ApiError

T = TypeVar("T")


def attach(app: FastAPI, parts: Any) -> None:
    """Make `parts` what every route of `app` receives (called once, by the app's lifespan)."""
    app.state.parts = parts


def attached(app: FastAPI) -> Any | None:
    """The parts attached to `app`, or None while it starts."""
    return getattr(app.state, "parts", None)


def parts_dependency(parts_type: type[T]) -> Callable[[Request], Awaitable[T]]:
    """A FastAPI dependency returning the request's app's parts (typed as `parts_type`); 503
    `starting` before they are attached. A coroutine function, so FastAPI calls it on the event
    loop (a plain function would cost every request a trip through the thread pool)."""

    async def parts_of(request: Request) -> T:
        parts = attached(request.app)
        if parts is None:
            raise ApiError(503, "unavailable", "the service is starting", None)
        return parts

    parts_of.__name__ = f"{parts_type.__name__.lower()}_of"
    return parts_of


def add_routes(app: FastAPI, router: APIRouter) -> None:
    """Serve the routes of `router` (a routes.py module's) as `app`'s own routes. Not
    `app.include_router`: since FastAPI 0.165 that adds one lazy entry for the whole router, which
    `app.routes` readers and the 405 `Allow` header (shellrl/service/app.py) do not look into."""
    app.router.routes.extend(router.routes)
