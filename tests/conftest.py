"""Shared fixtures: a real redis-server per test (or per module), temp dirs.

Every test passes alone (`pytest path::test`), every module passes alone, and the whole suite
passes in any order (`make test-random SEED=n`, pytest-randomly). To check the first for many tests
in one process, `pytest --each-alone PATH` (or SHELLRL_TEST_EACH_ALONE=1) tears down every fixture,
of every scope (module, package, session), after each test: each test then builds exactly the
fixtures it would build alone, and sees nothing another test left in them.
"""

from __future__ import annotations

import os

import pytest
from _pytest.runner import runtestprotocol

from tests.helpers.redis_server import RedisServer


def pytest_addoption(parser):
    parser.addoption(
        "--each-alone",
        action="store_true",
        default=os.environ.get("SHELLRL_TEST_EACH_ALONE") == "1",
        help="tear down fixtures of every scope after each test, as if each test ran alone "
        "(env SHELLRL_TEST_EACH_ALONE=1)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """pytest's own protocol (_pytest/runner.py) with no next item: the setup state is torn down to
    the session, so module-, package- and session-scoped fixtures are finished after each test."""
    if not item.config.getoption("each_alone"):
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    runtestprotocol(item, nextitem=None, log=True)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


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
