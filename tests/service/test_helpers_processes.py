"""The test helpers never leave a process behind: not when a start fails, and not when the pytest
that started them is killed (SIGKILL), stopped (SIGTERM) or times out (pytest-timeout): every
process a test starts dies with it (tests/helpers/owned_processes.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.helpers.owned_processes import popen_owned, run_owned
from tests.helpers.processes import REPO, ServiceProcess
from tests.helpers.redis_server import RedisServer, free_port
from tests.helpers.waiting import wait_until


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


# A process started any other way survives a SIGKILLed pytest. Not matched: os.fork, which helper
# scripts use inside a process that was started owned (its forks stay in its group and environment).
_SPAWN = re.compile(
    r"\bsubprocess\.(Popen|run|call|check_call|check_output|getoutput|getstatusoutput)\("
    r"|\bcreate_subprocess_(exec|shell)\(|\bos\.(system|popen|spawn\w*|posix_spawnp?)\("
)
# the mechanism itself, and the session whose family leaves its group on purpose
_SPAWNS_ITSELF = {"tests/helpers/owned_processes.py", "tests/helpers/session_to_kill.py"}


def test_every_process_a_test_starts_goes_through_popen_owned():
    """tests/ starts processes only with popen_owned / run_owned (or a helper built on them)."""
    found = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        if path.relative_to(REPO).as_posix() not in _SPAWNS_ITSELF
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _SPAWN.search(line)
    ]
    assert not found, (
        "start it with tests/helpers/owned_processes.py (popen_owned, run_owned):\n"
        + ("\n".join(found))
    )


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


@pytest.fixture
def workspace_root():
    """The sandbox's workspace root: searchable by other users (pytest's tmp_path is not)."""
    root = Path(tempfile.mkdtemp(prefix="shellrl-session-to-kill-"))
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _start_session_to_kill(
    probe_dir: Path, workspace_root: Path, *pytest_args: str
) -> subprocess.Popen:
    """A child pytest running tests/helpers/session_to_kill.py, its output in probe_dir/pytest.log."""
    env = {**os.environ, "PROBE_DIR": str(probe_dir), "PROBE_WORKSPACE_ROOT": str(workspace_root)}
    with open(probe_dir / "pytest.log", "wb") as log:
        return popen_owned(
            [sys.executable, "-m", "pytest", "tests/helpers/session_to_kill.py", "-q"]
            + ["-p", "no:cacheprovider", "-p", "no:randomly", *pytest_args],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _wait_until_running(session: subprocess.Popen, probe_dir: Path) -> dict[str, int]:
    """The pids in ready.json, once the session wrote it; each one running with its LEAK_PROBE."""
    ready = probe_dir / "ready.json"
    wait_until(lambda: ready.exists() or session.poll() is not None, 120, "ready.json")
    assert session.poll() is None, (probe_dir / "pytest.log").read_text()
    pids = json.loads(ready.read_text())
    assert set(pids.values()) <= set(_pids_with_env("LEAK_PROBE", str(probe_dir))), pids
    return pids


GRACEFUL = (0, -signal.SIGTERM)  # uvicorn re-raises the SIGTERM it handled once it has drained


def _service_exit_in_teardown(probe_dir: Path) -> int | None:
    """The service's exit status that the session's teardown wrote, None when none ran."""
    teardown = probe_dir / "teardown.json"
    return json.loads(teardown.read_text())["service_exit"] if teardown.exists() else None


def _wait_until_none_left(probe_dir: Path) -> None:
    left = lambda: _pids_with_env("LEAK_PROBE", str(probe_dir))
    wait_until(lambda: not left(), 30, "no process of the ended pytest", poll_s=0.1)


@pytest.mark.slow
def test_a_sigkilled_pytest_leaves_neither_its_service_nor_any_grandchild_running(
    tmp_path, workspace_root
):
    session = _start_session_to_kill(tmp_path, workspace_root)
    pids = _wait_until_running(session, tmp_path)
    assert pids.keys() == {"service", "family", "in_group", "escaped"}
    session.kill()
    assert session.wait() == -signal.SIGKILL
    _wait_until_none_left(tmp_path)
    assert _service_exit_in_teardown(tmp_path) is None  # no teardown ran: PDEATHSIG and the reaper


@pytest.mark.slow
def test_a_sigterm_to_pytest_runs_the_teardowns_that_stop_its_services(tmp_path, workspace_root):
    session = _start_session_to_kill(tmp_path, workspace_root)
    _wait_until_running(session, tmp_path)
    session.send_signal(signal.SIGTERM)
    assert session.wait(60) == pytest.ExitCode.INTERRUPTED, (tmp_path / "pytest.log").read_text()
    assert _service_exit_in_teardown(tmp_path) in GRACEFUL  # stopped by its fixture
    _wait_until_none_left(tmp_path)  # the escaped grandchild too: the reaper, at pytest's exit


@pytest.mark.slow
@pytest.mark.parametrize("method", ["signal", "thread"])
def test_a_pytest_timeout_leaves_no_process_running(tmp_path, workspace_root, method):
    """signal (the default on Linux): the test fails and the teardowns run; thread: pytest-timeout
    calls os._exit, no teardown runs, PDEATHSIG and the reaper kill everything."""
    session = _start_session_to_kill(
        tmp_path,
        workspace_root,
        "--timeout=5",
        f"--timeout-method={method}",
        "-o",
        "timeout_func_only=true",
    )
    _wait_until_running(session, tmp_path)
    assert session.wait(60) == 1
    assert "Timeout" in (tmp_path / "pytest.log").read_text()
    assert _service_exit_in_teardown(tmp_path) in (GRACEFUL if method == "signal" else (None,))
    _wait_until_none_left(tmp_path)


def test_run_owned_kills_the_whole_process_group_when_it_times_out(tmp_path):
    script = "sleep 3600 & echo started; wait"
    env = {**os.environ, "LEAK_PROBE": str(tmp_path)}
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        run_owned(["sh", "-c", script], timeout_s=1, env=env, capture_output=True, text=True)
    assert raised.value.stdout == "started\n"
    _wait_until_none_left(tmp_path)
