"""`shellrl` tables with stdout piped (issue 34): the real `shellrl status` and `status --watch` in
their own processes, stdout and stderr into one pipe, against a real redis-server and services
that do not answer (a table wider than 80 columns: the services row).

Off a terminal rich assumed 80 columns: the services row was wrapped onto two lines, and the live
table of `--watch` ended its bottom border without a newline, so the `down:` line that followed
ran into it (`└──┘down: rollout, ...`). Now every line of a table is whole: it starts and ends
with a border, all have one width, the services row is one line, and the next output starts on a
line of its own.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import redis as sync_redis

from tests.helpers.owned_processes import popen_owned, run_owned, stop_owned
from tests.helpers.processes import REPO
from tests.helpers.redis_server import RedisServer
from tests.helpers.waiting import wait_until

# `python -m cli.main` with Ctrl-C as a terminal gives it: a pytest started as a background job of
# a non-interactive shell (`bash .ci/run &`, nohup ...) has SIGINT ignored, every child inherits
# that, and a Python started so never installs its KeyboardInterrupt handler: the SIGINT below
# would be lost and `status --watch` run on (both CI runs at 4c3a39b failed so)
WITH_CTRL_C = (
    "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "runpy.run_module('cli.main', run_name='__main__', alter_sys=True)"
)
NOWHERE = "http://127.0.0.1:9"
SERVICES = ("rollout", "learner", "sandbox", "verifier", "engine")
BORDERS = "┌┏│┃├┡└┗"  # a table line's first character (rich's box and heavy-head box)


def write_stack(state_dir, redis_url: str) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    stack = {
        "launcher_pid": 0,
        "processes": {},
        "urls": dict.fromkeys(SERVICES, NOWHERE),
        "redis_url": redis_url,
        "started_at": time.time(),
    }
    (state_dir / "stack.json").write_text(json.dumps(stack))


def check_table(output: str) -> None:
    """The table in `output` (the lines from its top border to its bottom border) is whole, and
    the line after it is not a table line."""
    lines = output.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith(("┌", "┏")))
    bottom = next(i for i, line in enumerate(lines) if line.startswith(("└", "┗")))
    table = lines[top : bottom + 1]
    assert all(line[0] in BORDERS and line[-1] in "┐┓│┃┤┩┘┛" for line in table), output
    assert len({len(line) for line in table}) == 1, output
    assert table[-1].rstrip("┘┛")[-1] == "─", output  # nothing printed after the border
    services = [line for line in table if "services" in line]
    assert len(services) == 1 and all(f"{s}:down" in services[0] for s in SERVICES), output
    assert lines[bottom + 1] == f"down: {', '.join(SERVICES)}", output


def test_status_piped_prints_its_table_whole(tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    try:
        write_stack(tmp_path / "state", redis.url)
        done = run_owned(
            [sys.executable, "-m", "cli.main", "status", "--state-dir", str(tmp_path / "state")],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout_s=60,
        )
        assert done.returncode == 1, done.stdout
        check_table(done.stdout)
    finally:
        redis.stop()


def test_status_watch_piped_ends_its_live_table_on_a_line_of_its_own(tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    client = sync_redis.Redis.from_url(redis.url)
    try:
        write_stack(tmp_path / "state", redis.url)
        before = client.info("stats")["total_connections_received"]
        argv = ["status", "--watch", "--state-dir", str(tmp_path / "state")]
        proc = popen_owned(
            [sys.executable, "-c", WITH_CTRL_C, *argv],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            # the second snapshot connects to Redis inside the watch loop: Ctrl-C ends it there
            wait_until(
                lambda: client.info("stats")["total_connections_received"] >= before + 2,
                60,
                "status --watch taking its second snapshot",
            )
            proc.send_signal(signal.SIGINT)
            output, _ = proc.communicate(timeout=60)
        finally:
            stop_owned(proc)
        assert proc.returncode == 1, output
        check_table(output)
    finally:
        client.close()
        redis.stop()
