"""`shellrl up` (cli.commands.up.up) stops the stack when one of its processes exits and names it
with its exit status, failure class, log and last error line, as `shellrl run` does (issue 34
item 5). A real `up` in a subprocess over Redis and a sandbox; the sandbox is SIGKILLed by the
pid the launcher recorded."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import pytest

from tests.helpers.owned_processes import popen_owned, stop_owned
from tests.helpers.port_offsets import free_port_offsets
from tests.helpers.processes import REPO

pytestmark = pytest.mark.slow

UP = """
import dataclasses, sys
from cli.commands import up as up_command
from cli.commands.up import up
from cli.main import parse
args = parse(["up", "--model-path", "tiny", "--quiet", "--state-dir", sys.argv[1],
              "--port-offset", sys.argv[2]])
config = dataclasses.replace(up_command.stack_config(args), services=("sandbox",))
sys.exit(up(config))
"""


def test_up_names_the_process_that_died_with_its_status_and_log(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o755)  # the sandbox's workspace root must be traversable by other uids
    proc = popen_owned(
        [sys.executable, "-c", UP, str(state), str(free_port_offsets(1, ("sandbox",))[0])],
        cwd=REPO,
        stderr=open(tmp_path / "stderr", "w"),  # noqa: SIM115 (the child holds it)
        stdout=open(tmp_path / "stdout", "w"),  # noqa: SIM115
    )
    try:
        deadline = time.monotonic() + 120
        while not (state / "stack.json").exists():
            assert proc.poll() is None, (tmp_path / "stderr").read_text()
            assert time.monotonic() < deadline, "the stack did not start"
            time.sleep(0.5)
        sandbox = json.loads((state / "stack.json").read_text())["processes"]["sandbox"]
        os.kill(sandbox, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            stop_owned(proc)
    err = (tmp_path / "stderr").read_text().strip().splitlines()[-1]
    assert err.startswith("sandbox exited with status -9: killed"), err
    assert str(state / "logs") in err and err.endswith("shutting the stack down")
