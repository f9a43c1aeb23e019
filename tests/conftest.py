"""Shared fixtures: a real redis-server per test (or per module), temp dirs."""

from __future__ import annotations

import pytest

from tests.helpers.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def module_redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sandbox_services(tmp_path_factory):
    """Factory of real sandbox services: `sandbox_services.get("bubblewrap"|"unshare"|"fallback",
    **settings)`; each configuration starts once per test session and stops at its end."""
    from tests.helpers.sandbox_service import SandboxServices

    services = SandboxServices(tmp_path_factory.mktemp("sandbox"))
    yield services
    services.stop_all()
