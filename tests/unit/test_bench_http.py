"""benchmarks/bench_http.py's wait for a uvicorn server's first answer: it gave up silently after
200 x 50 ms (10 s, then the first timed request raised ConnectError), shorter than a FastAPI
server's start on 2 busy cores; now a deadline, and an exited server is reported at once."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import pytest

from benchmarks.bench_http import START_DEADLINE_S, wait_serving
from tests.helpers.owned_processes import popen_owned
from tests.helpers.redis_server import free_port

LATE_SERVER = """
import http.server, sys, time
time.sleep(float(sys.argv[2]))
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), http.server.SimpleHTTPRequestHandler).serve_forever()
"""


def _wait(url: str, proc: subprocess.Popen, deadline_s: float) -> float:
    async def go() -> float:
        start = time.monotonic()
        async with httpx.AsyncClient() as client:
            await wait_serving(client, url, proc, deadline_s)
        return time.monotonic() - start

    return asyncio.run(go())


def test_the_start_deadline_outlasts_a_slow_start_under_load():
    assert START_DEADLINE_S >= 60


def test_a_server_that_answers_late_is_waited_for():
    port = free_port()
    proc = popen_owned([sys.executable, "-c", LATE_SERVER, str(port), "1.0"])
    try:
        waited = _wait(f"http://127.0.0.1:{port}/", proc, deadline_s=120)
    finally:
        proc.kill()
        proc.wait()
    assert waited >= 1.0


def test_a_server_that_exited_is_reported_at_once_not_after_the_deadline():
    proc = popen_owned([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 3"):
        _wait(f"http://127.0.0.1:{free_port()}/", proc, deadline_s=120)
    assert time.monotonic() - start < 30


def test_a_server_that_never_answers_raises_after_the_deadline():
    proc = popen_owned([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        with pytest.raises(TimeoutError, match="within 0.5 s"):
            _wait(f"http://127.0.0.1:{free_port()}/", proc, deadline_s=0.5)
    finally:
        proc.kill()
        proc.wait()
