"""Run one launched command: capped output capture, wall-clock timeout, whole-tree kill.

Completion is "the launcher process exited" (or the deadline), never "the pipes reached EOF":
a background process that keeps stdout open cannot make an exec hang. After the launcher exits
every process the command left behind is killed (the pid namespace does this for bubblewrap and
unshare; the session cgroup, or the session uid, for the fallback), then the pipes are drained for
at most `drain_s`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from services.sandbox.execution.runner import Capture
from services.sandbox.isolation.launch import Launch

TIMEOUT_EXIT_CODE = 124  # like GNU timeout(1); `timed_out` says it explicitly
SETUP_ERROR_EXIT_CODE = 125


class OutputBuffer(Capture):
    """runner.py's `Capture` (the first `cap - cap // 2` and last `cap // 2` bytes of a stream,
    and its total size), rendered for the response."""

    @property
    def truncated_bytes(self) -> int:
        return self.total - len(self.head) - min(len(self.tail), self.tail_cap)

    def text(self) -> str:
        head, tail = self.parts()
        return render_output(head, tail, self.total)


def render_output(head: bytes, tail: bytes, total: int) -> str:
    """UTF-8 with replacement (invalid bytes and NULs never raise); a `…[truncated N bytes]…`
    marker between head and tail where `total - len(head) - len(tail)` bytes were dropped."""
    dropped = total - len(head) - len(tail)
    if dropped <= 0:
        return (head + tail).decode("utf-8", errors="replace")
    return (
        head.decode("utf-8", errors="replace")
        + f"\n…[truncated {dropped} bytes]…\n"
        + tail.decode("utf-8", errors="replace")
    )


@dataclass(frozen=True)
class RawExec:
    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    stdout_truncated_bytes: int
    stderr_truncated_bytes: int
    duration_ms: float
    queue_ms: float = 0.0  # waited for an exec slot before it started


class _Protocol(asyncio.SubprocessProtocol):
    def __init__(self, out: OutputBuffer, err: OutputBuffer) -> None:
        loop = asyncio.get_running_loop()
        self.out, self.err = out, err
        self.exited = loop.create_future()
        self.closed = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        (self.out if fd == 1 else self.err).feed(data)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _exit_code(returncode: int | None) -> int:
    if returncode is None:
        return -1
    return 128 - returncode if returncode < 0 else returncode


async def run_launch(
    launch: Launch,
    timeout_s: float,
    max_output_bytes: int,
    kill_tree: Callable[[int], None],
    drain_s: float = 0.5,
) -> RawExec:
    """Run `launch` to completion or deadline.

    `kill_tree(pid)` must SIGKILL the launcher's process group and every other process of the
    session (cgroup / uid sweep); it is called on timeout and after the launcher exits.
    """
    loop = asyncio.get_running_loop()
    out, err = OutputBuffer(max_output_bytes), OutputBuffer(max_output_bytes)
    start = time.perf_counter()
    argv, pass_fds = launch.spawn_args()
    try:
        transport, protocol = await loop.subprocess_exec(
            lambda: _Protocol(out, err),
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=launch.env,
            cwd=launch.cwd,
            start_new_session=True,
            close_fds=True,
            pass_fds=pass_fds,
        )
    finally:
        for fd in pass_fds:
            os.close(fd)
    pid = transport.get_pid()
    timed_out = False
    try:
        try:
            await asyncio.wait_for(asyncio.shield(protocol.exited), timeout_s)
        except TimeoutError:
            timed_out = True
            kill_tree(pid)
            await protocol.exited
        returncode = transport.get_returncode()
        if not protocol.closed.done():
            kill_tree(pid)  # leftovers holding the pipes (fallback layer without a pid namespace)
            try:
                await asyncio.wait_for(asyncio.shield(protocol.closed), drain_s)
            except TimeoutError:
                pass
    finally:
        if transport.get_returncode() is None:
            kill_tree(pid)
        transport.close()
    duration_ms = (time.perf_counter() - start) * 1000.0
    return RawExec(
        stdout=out.text(),
        stderr=err.text(),
        exit_code=TIMEOUT_EXIT_CODE if timed_out else _exit_code(returncode),
        timed_out=timed_out,
        stdout_truncated_bytes=out.truncated_bytes,
        stderr_truncated_bytes=err.truncated_bytes,
        duration_ms=duration_ms,
    )


def kill_process_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
