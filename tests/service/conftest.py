"""Fixtures shared by the service tests."""

from __future__ import annotations

import pytest

from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port


@pytest.fixture(scope="module")
def sandbox_url(tmp_path_factory):
    """URL of a real sandbox service (`python -m services.sandbox`, default settings) of this
    module's own: its sessions and workspaces are shared by no other module."""
    proc = ServiceProcess(
        "sandbox",
        free_port(),
        {"SHELLRL_LOG_LEVEL": "WARNING"},
        tmp_path_factory.mktemp("sandbox-logs"),
    ).start()
    yield proc.url
    proc.stop()
