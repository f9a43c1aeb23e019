"""Processes that die with the pytest that started them (issue 29, item 4).

Every process a test starts goes through `popen_owned` (or `run_owned`, its `subprocess.run`).
Such a process
  - runs in a session, so a process group, of its own: a Ctrl-C meant for pytest does not reach
    it before pytest's teardown stops it, and `stop_owned` / `kill_group` reach all of it;
  - gets PR_SET_PDEATHSIG(SIGKILL): the kernel kills it as soon as pytest dies. That signal fires
    when the *thread* that forked it exits, and tests start engines from pool threads and restart
    Redis from a threading.Thread; so every start goes through one spawner thread that lives as
    long as pytest does;
  - carries TESTS_PROCESS_OWNER=<this pytest's token> in its environment, which its descendants
    inherit unless they are given another environment;
  - has its process group registered with this pytest's reaper (tests/helpers/process_reaper.py),
    a small process started on first use in a session of its own. When pytest is gone, however
    it went (SIGKILL, pytest-timeout's thread method, which calls os._exit), the reaper SIGKILLs
    those groups and every process holding the token: the grandchildren too (torchrun's ranks, the
    services of a `shellrl run` job), which the PDEATHSIG of their parent does not reach.

A fixture's teardown still stops its processes gracefully (`stop_owned`: SIGTERM, a grace period,
then SIGKILL of the group); the reaper is only the safety net. A SIGTERM to pytest runs the
teardowns (`sigterm_runs_teardowns`, installed by tests/conftest.py).

Processes the cli launcher starts in this pytest (cli.launcher.Stack) have its own PDEATHSIG
(SIGTERM) and sessions; tests hand their groups to the reaper with `adopt_stack`.
"""

from __future__ import annotations

import ctypes
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

from tests.helpers.process_reaper import OWNER_VARIABLE, start_time

_PR_SET_PDEATHSIG = 1
_SIGKILL = int(signal.SIGKILL)
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the forked child only calls it
_REAPER_SCRIPT = str(Path(__file__).with_name("process_reaper.py"))


class _Reaper:
    """The write end of the pipe to this pytest's reaper, which it starts on first use."""

    def __init__(self) -> None:
        self.owner = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.lock = threading.Lock()
        self.lines: list[bytes] = []  # every group registered, for a reaper started again
        self.write_fd: int | None = None
        self.process: subprocess.Popen | None = None  # kept: never waited for while pytest runs

    def register(self, pgid: int) -> None:
        started = start_time(pgid)
        if started is None:
            return  # gone already
        line = f"{pgid} {started}\n".encode()
        with self.lock:
            self.lines.append(line)
            if self.write_fd is not None:
                try:
                    os.write(self.write_fd, line)
                    return
                except BrokenPipeError:  # someone killed the reaper: start another one
                    os.close(self.write_fd)
            self._start()
            os.write(self.write_fd, b"".join(self.lines))

    def _start(self) -> None:
        read_fd, write_fd = os.pipe()  # neither end is inherited by the processes pytest starts
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", _REAPER_SCRIPT, self.owner],
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd="/",
                env={k: v for k, v in os.environ.items() if k != OWNER_VARIABLE},
                start_new_session=True,  # a signal to pytest's process group does not reach it
            )
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        self.write_fd = write_fd


class _Spawner:
    """One daemon thread that forks every owned process: it exits only with pytest, so the
    children's PR_SET_PDEATHSIG fires then and not when a test's worker thread ends."""

    def __init__(self) -> None:
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="owned-process-spawner", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call, future = self.requests.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as exc:
                    future.set_exception(exc)

    def run(self, start: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        future: Future = Future()
        self.requests.put((start, future))
        try:
            return future.result()
        except BaseException:  # e.g. KeyboardInterrupt while waiting: the start still completes
            future.add_done_callback(lambda f: f.exception() is None and kill_group(f.result()))
            raise


_state_lock = threading.Lock()
_reaper: _Reaper | None = None
_spawner: _Spawner | None = None


def _owned_state() -> tuple[_Reaper, _Spawner]:
    global _reaper, _spawner
    with _state_lock:
        if _reaper is None:
            _reaper, _spawner = _Reaper(), _Spawner()
        return _reaper, _spawner


def _after_fork_in_child() -> None:
    """os.fork (multiprocessing's): the child must not hold the reaper's pipe open, or the reaper
    would wait for the child too; a popen_owned in the child starts a reaper of its own."""
    global _state_lock, _reaper, _spawner
    if _reaper is not None and _reaper.write_fd is not None:
        os.close(_reaper.write_fd)
    _state_lock, _reaper, _spawner = threading.Lock(), None, None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _die_with(parent_pid: int) -> None:
    """preexec_fn: runs in the child between fork and exec."""
    if _prctl(_PR_SET_PDEATHSIG, _SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent_pid:  # pytest died before the prctl: no signal would come
        os.kill(os.getpid(), _SIGKILL)


def popen_owned(argv: Sequence[str], *, env=None, **popen_kwargs) -> subprocess.Popen:
    """`subprocess.Popen(argv, env=env, **popen_kwargs)` of a process that dies with this pytest
    (module docstring). `env` defaults to os.environ, as Popen's does; the owner token is added.

    Raises what Popen raises; TypeError for start_new_session, process_group or preexec_fn, which
    this sets itself."""
    taken = {"start_new_session", "process_group", "preexec_fn"} & popen_kwargs.keys()
    if taken:
        raise TypeError(f"popen_owned sets {', '.join(sorted(taken))} itself")
    reaper, spawner = _owned_state()
    env = {**(os.environ if env is None else env), OWNER_VARIABLE: reaper.owner}
    parent_pid = os.getpid()

    def start() -> subprocess.Popen:
        proc = subprocess.Popen(
            argv,
            env=env,
            start_new_session=True,
            preexec_fn=lambda: _die_with(parent_pid),
            **popen_kwargs,
        )
        try:
            reaper.register(proc.pid)
        except BaseException:
            kill_group(proc)
            proc.wait()
            raise
        return proc

    return spawner.run(start)


def run_owned(
    argv: Sequence[str],
    *,
    timeout_s: float,
    input=None,
    capture_output: bool = False,
    check: bool = False,
    **popen_kwargs,
) -> subprocess.CompletedProcess:
    """`subprocess.run` of an owned process: after `timeout_s` seconds (or on any exception while
    it waits, KeyboardInterrupt included) its whole process group is SIGKILLed, not only the
    process itself, then subprocess.TimeoutExpired raised (as subprocess.run does).
    Raises subprocess.CalledProcessError for a non-zero status when `check`."""
    if capture_output:
        popen_kwargs |= {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    if input is not None:
        popen_kwargs["stdin"] = subprocess.PIPE
    with popen_owned(argv, **popen_kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            kill_group(proc)
            try:
                exc.stdout, exc.stderr = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                pass  # a descendant that left the group holds the pipes: no output, then
            raise
        except BaseException:
            kill_group(proc)
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if check:
        done.check_returncode()
    return done


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (popen_owned's), what is left of it included."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_owned(proc: subprocess.Popen, grace_s: float = 15.0, sig: int = signal.SIGTERM) -> int:
    """`sig` to the process (it stops its own children: torchrun passes SIGTERM to its ranks),
    up to `grace_s` seconds for it to exit, then SIGKILL of its process group, leftovers included.
    Returns its exit status (negative: the signal that ended it)."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    kill_group(proc)
    return proc.wait()


def adopt_group(pgid: int) -> None:
    """Hand a process group this pytest started some other way to the reaper: it is SIGKILLed
    once pytest is gone. A pgid that no longer runs is ignored."""
    _owned_state()[0].register(pgid)


def adopt_stack(stack) -> None:
    """Hand the process groups of a cli.launcher.Stack started in this pytest (each service and
    Redis lead one) to the reaper; again after each `stack.restart`. The launcher's own
    PR_SET_PDEATHSIG sends them SIGTERM when pytest dies; the reaper SIGKILLs what is left."""
    for proc in stack.procs:
        adopt_group(proc.popen.pid)


@contextmanager
def sigterm_runs_teardowns() -> Iterator[None]:
    """While active, a SIGTERM to this pytest raises KeyboardInterrupt in its main thread: pytest
    ends the run as at Ctrl-C and tears down every fixture set up so far, whose teardowns stop the
    processes the tests started. KeyboardInterrupt rather than pytest.exit, which is an Exception
    a test's `except Exception` would swallow. A second SIGTERM kills pytest at once (the reaper
    kills what is left). pytest-timeout's signal method uses SIGALRM: it is not affected."""

    def interrupt(signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) in (interrupt, signal.SIG_DFL):
            signal.signal(signal.SIGTERM, previous)
