"""A pytest session to kill. tests/service/test_helpers_processes.py runs this module in a child
pytest (`pytest tests/helpers/session_to_kill.py`; its name keeps it out of the suite) and ends
that pytest once it is ready: SIGKILL, SIGTERM, or its own --timeout.

Its one test starts, through the shared helpers, a real sandbox service (from a worker thread that
has exited before the test blocks, as tests/service/test_engine_registry.py starts engines) and a
process with two children: one in its process group, one that left it (setsid). All four carry
LEAK_PROBE=$PROBE_DIR in their environment; the service's workspace root is $PROBE_WORKSPACE_ROOT
(searchable by other users, as the sandbox requires: pytest's temp directories are not). With all
of them running, the test writes $PROBE_DIR/ready.json (their pids) and blocks; the fixtures'
teardown, if it runs, writes $PROBE_DIR/teardown.json (the service's exit status).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers.owned_processes import popen_owned, stop_owned
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port

FAMILY = """
import subprocess, sys, time
in_group = subprocess.Popen(["sleep", "3600"])
escaped = subprocess.Popen(["sleep", "3600"], start_new_session=True)
print(in_group.pid, escaped.pid, flush=True)
time.sleep(3600)
"""


@pytest.fixture
def probe_dir() -> Path:
    return Path(os.environ["PROBE_DIR"])


@pytest.fixture
def service(probe_dir):
    env = {
        "SHELLRL_SANDBOX_ISOLATION": "fallback",
        "SHELLRL_WORKSPACE_ROOT": os.environ["PROBE_WORKSPACE_ROOT"],
        "LEAK_PROBE": str(probe_dir),
    }
    sandbox = ServiceProcess("sandbox", free_port(), env, probe_dir)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(sandbox.start).result()
    sandbox.wait_ready(30)  # still serving once the thread that started it has exited
    yield sandbox
    code = sandbox.stop()
    (probe_dir / "teardown.json").write_text(json.dumps({"service_exit": code}))


@pytest.fixture
def family(probe_dir):
    proc = popen_owned(
        [sys.executable, "-c", FAMILY],
        env={**os.environ, "LEAK_PROBE": str(probe_dir)},
        stdout=subprocess.PIPE,
        text=True,
    )
    in_group, escaped = map(int, proc.stdout.readline().split())
    yield {"family": proc.pid, "in_group": in_group, "escaped": escaped}
    stop_owned(proc)  # its group: the escaped child is the reaper's, at pytest's exit
    proc.stdout.close()


def test_blocks_while_its_processes_run(service, family, probe_dir):
    ready = probe_dir / "ready.json.tmp"
    ready.write_text(json.dumps({"service": service.proc.pid, **family}))
    ready.rename(probe_dir / "ready.json")
    time.sleep(3600)  # until the test that started this pytest ends it
