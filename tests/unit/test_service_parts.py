"""shellrl/service/parts.py: how a service's routes reach its typed Parts."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from shellrl.service.app import create_app
from shellrl.service.parts import add_routes, attach, attached, parts_dependency


@dataclass
class Parts:
    greeting: str


PartsDep = Annotated[Parts, Depends(parts_dependency(Parts))]
router = APIRouter()


@router.get("/v1/greeting")
async def greeting(parts: PartsDep) -> dict:
    return {"greeting": parts.greeting}


@router.post("/v1/greeting")
async def set_greeting(parts: PartsDep) -> dict:
    return {"greeting": parts.greeting}


def app_with(parts: Parts | None):
    @contextlib.asynccontextmanager
    async def lifespan(app):
        if parts is not None:
            attach(app, parts)
        yield

    app = create_app("test", {}, lifespan=lifespan)
    add_routes(app, router)
    return app


def test_a_route_receives_the_parts_the_lifespan_attached():
    app = app_with(Parts("hello"))
    with TestClient(app) as client:
        assert client.get("/v1/greeting").json() == {"greeting": "hello"}
        assert attached(app) == Parts("hello")


def test_a_request_before_the_parts_are_attached_is_503_starting():
    with TestClient(app_with(None)) as client:
        response = client.get("/v1/greeting")
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "unavailable"


def test_the_parts_parameter_is_not_part_of_the_openapi_schema():
    operation = app_with(None).openapi()["paths"]["/v1/greeting"]["get"]
    assert "parameters" not in operation and "requestBody" not in operation


def test_added_routes_are_the_apps_own_and_a_405_names_every_method():
    app = app_with(Parts("hello"))
    paths = {(r.path, m) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}
    assert {("/v1/greeting", "GET"), ("/v1/greeting", "POST")} <= paths
    with TestClient(app) as client:
        response = client.delete("/v1/greeting")
    assert response.status_code == 405
    assert response.headers["allow"] == "GET, POST"
