"""The service's end of a session runner (`runner.py`, session mode): start it, send commands,
read results, stop it. Any protocol failure (the runner died, stopped answering past the
command's deadline plus a grace period, or answered garbage) raises `RunnerFailed`; the caller
then kills every process of the session and starts a new runner."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path

from services.sandbox.execution.executor import RawExec, render_output
from services.sandbox.isolation.launch import Launch

log = logging.getLogger(__name__)
RUNNER_SOURCE = Path(__file__).with_name("runner.py")  # copied into each session (session mode)
START_TIMEOUT_S = 20.0
GRACE_S = 5.0
EXIT_POLL_S = 0.05  # how often a read checks whether the launcher exited


class RunnerFailed(Exception):
    """The runner cannot be used any more (`hung` = it stopped answering in time)."""

    def __init__(self, message: str, hung: bool = False) -> None:
        super().__init__(message)
        self.hung = hung


@dataclass
class RunnerLink:
    launch: Launch
    proc: asyncio.subprocess.Process | None = None
    _stderr_task: asyncio.Task | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self, prelude: str, fresh_prelude: str) -> None:
        """Spawn the sandbox with the runner, wait for its READY line, send the saved-state and
        fresh-state preludes."""
        argv, pass_fds = self.launch.spawn_args()
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self.launch.env,
                cwd=self.launch.cwd,
                start_new_session=True,
                limit=1 << 26,
                pass_fds=pass_fds,
            )
        finally:
            for fd in pass_fds:
                os.close(fd)
        self._stderr_task = asyncio.create_task(self._log_stderr(self.proc))
        try:
            line = await self._read(self.proc.stdout.readline(), START_TIMEOUT_S)
        except TimeoutError:
            line = b""
        except RunnerFailed:
            await self.stop()
            raise
        if line != b"READY\n":
            await self.stop()
            raise RunnerFailed(f"runner did not start (first line {line[:200]!r})")
        data, fresh = prelude.encode(), fresh_prelude.encode()
        self.proc.stdin.write(b"INIT %d %d\n" % (len(data), len(fresh)) + data + fresh)
        await self.proc.stdin.drain()

    async def _read(self, read: Awaitable[bytes], timeout_s: float) -> bytes:
        """The runner's answer (`read` of its stdout) within `timeout_s` (TimeoutError after).
        RunnerFailed as soon as the launcher exits without one: a sandbox orphaned by a launcher
        killed right after its start (known_pitfalls D06, bubblewrap#633: the death signal never
        armed) may hold the pipe open until the caller's cgroup / uid sweep kills it."""
        reading, exited = asyncio.ensure_future(read), asyncio.ensure_future(self._exited())
        try:
            done, _ = await asyncio.wait(
                {reading, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            exited.cancel()
            if not reading.done():
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reading
        if reading in done:
            return reading.result()
        if exited in done:
            raise RunnerFailed(f"runner launcher exited with status {self.proc.returncode}")
        raise TimeoutError

    async def _exited(self) -> None:
        """Returns once the launcher has exited. Polled: before Python 3.12, `Process.wait()`
        returns only when every pipe is closed too, which an orphaned sandbox prevents."""
        while self.proc.returncode is None:
            await asyncio.sleep(EXIT_POLL_S)

    async def _log_stderr(self, proc) -> None:
        while line := await proc.stderr.readline():
            log.warning(
                "runner stderr", extra={"line": line.decode(errors="replace").rstrip()[:2000]}
            )

    async def exec(
        self, command: bytes, timeout_s: float, max_output_bytes: int, fresh_state: bool = False
    ) -> RawExec:
        """Run one command (with the fresh-state prelude if `fresh_state`); RunnerFailed when the
        runner cannot deliver a result."""
        if not self.alive:
            raise RunnerFailed("runner is not running")
        start = time.perf_counter()
        header = (
            f"EXEC {max(1, int(timeout_s * 1000))} {max_output_bytes} {len(command)}"
            f" {int(fresh_state)}\n"
        ).encode()
        try:
            self.proc.stdin.write(header + command)
            await self.proc.stdin.drain()
            line = await self._read(self.proc.stdout.readline(), timeout_s + GRACE_S)
            fields = line.split()
            if len(fields) != 10 or fields[0] != b"DONE":
                raise RunnerFailed(f"runner ended or answered {line[:200]!r}")
            exit_code, timed_out, out_total, err_total, _, *lengths = (int(x) for x in fields[1:])
            blob = await self._read(self.proc.stdout.readexactly(sum(lengths)), GRACE_S)
        except TimeoutError:
            raise RunnerFailed(
                f"runner gave no result within timeout_s + {GRACE_S} s", hung=True
            ) from None
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
            raise RunnerFailed(f"runner connection failed: {exc!r}") from None
        parts, offset = [], 0
        for n in lengths:
            parts.append(blob[offset : offset + n])
            offset += n
        out_head, out_tail, err_head, err_tail = parts
        return RawExec(
            stdout=render_output(out_head, out_tail, out_total),
            stderr=render_output(err_head, err_tail, err_total),
            exit_code=exit_code,
            timed_out=bool(timed_out),
            stdout_truncated_bytes=out_total - len(out_head) - len(out_tail),
            stderr_truncated_bytes=err_total - len(err_head) - len(err_tail),
            duration_ms=(time.perf_counter() - start) * 1000.0,
        )

    async def kill_all(self, remove_ipc: bool = False) -> None:
        """Every process of the session but the runner dies (before a reset), and with
        `remove_ipc` every SysV IPC object of the session uid in the runner's IPC namespace;
        RunnerFailed if the runner does not confirm within GRACE_S."""
        if not self.alive:
            raise RunnerFailed("runner is not running")
        try:
            self.proc.stdin.write(b"RESET\n" if remove_ipc else b"KILL\n")
            await self.proc.stdin.drain()
            line = await self._read(self.proc.stdout.readline(), GRACE_S)
        except (TimeoutError, ConnectionError) as exc:
            raise RunnerFailed(f"runner did not confirm KILL: {exc!r}") from None
        if line != b"KILLED\n":
            raise RunnerFailed(f"runner answered {line[:200]!r} to KILL")

    async def stop(self) -> None:
        """SIGKILL the launcher's process group; bwrap/unshare take the namespace down with it.
        The caller also sweeps the session cgroup (the fallback layer has no namespace)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 5.0)
        except TimeoutError:
            log.error("runner launcher did not exit after SIGKILL", extra={"pid": proc.pid})
        if self._stderr_task is not None:
            self._stderr_task.cancel()
