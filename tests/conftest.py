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


# --- processes die with pytest (issue 29, item 4: tests/helpers/owned_processes.py) ----------
@pytest.fixture(scope="session", autouse=True)
def _sigterm_runs_teardowns():
    """A SIGTERM to pytest ends the run as Ctrl-C does: the teardowns of the fixtures set up so far
    run and stop the processes the tests started (a SIGKILL runs none: then the reaper of
    tests/helpers/owned_processes.py kills them)."""
    from tests.helpers.owned_processes import sigterm_runs_teardowns

    with sigterm_runs_teardowns():
        yield


# --- end of: processes die with pytest -------------------------------------------------------
