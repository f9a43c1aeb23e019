"""The test helpers never leave a process behind, even when a start fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import RedisServer, free_port


def _pids_with_env(name: str, value: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"{name}={value}".encode() in environ:
                pids.append(int(entry))
    return pids


def test_a_service_that_is_not_ready_in_time_is_stopped_not_leaked(tmp_path):
    port = free_port()
    env = {"SHELLRL_SANDBOX_ISOLATION": "fallback", "SHELLRL_WORKSPACE_ROOT": str(tmp_path / "ws")}
    service = ServiceProcess("sandbox", port, env, tmp_path)
    with pytest.raises(RuntimeError, match="not ready after"):
        service.start(ready_timeout_s=0.05)
    assert service.proc is None
    assert _pids_with_env("SHELLRL_PORT", str(port)) == []


def test_redis_server_restart_keeps_port_and_data_directory(tmp_path):
    server = RedisServer(tmp_path / "r").start()
    port = server.port
    try:
        server.restart()
        assert server.port == port and server.proc.poll() is None
        assert list((tmp_path / "r").glob("appendonlydir/*.aof"))  # AOF in the given directory
    finally:
        server.stop()
    assert server.proc is None
