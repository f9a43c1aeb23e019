"""The hand-over from the HTTP event loop to the scheduler thread (scheduler.py): requests that
arrived, commands to run between two forward passes, and the rids that are live.

Thread-safe: the HTTP side calls `submit` and `call`, the scheduler thread `take_requests`,
`run_commands` and `release`, all under one lock. `wake` is set whenever something arrives; the
scheduler thread waits on it while it has nothing to do.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass

from services.engine.request_state import DuplicateRequestId, RequestState


@dataclass
class _Command:
    fn: Callable[[], object]
    result: concurrent.futures.Future
    when_idle: bool


class Intake:
    """New requests, pending commands and live rids (see the module docstring)."""

    def __init__(self) -> None:
        self.wake = threading.Event()
        self._lock = threading.Lock()
        self._inbox: list[RequestState] = []
        self._commands: list[_Command] = []
        self._rids: set[str] = set()

    # ----- called from the HTTP event loop --------------------------------------------------------

    def submit(self, states: list[RequestState]) -> None:
        """Queue the requests, all or none: DuplicateRequestId if any rid is already live (nothing
        is queued then)."""
        with self._lock:
            for state in states:
                if state.spec.rid in self._rids:
                    raise DuplicateRequestId(f"Duplicate request ID detected: {state.spec.rid}")
            self._rids.update(state.spec.rid for state in states)
            self._inbox.extend(states)
        self.wake.set()

    def call(self, fn: Callable[[], object], when_idle: bool) -> concurrent.futures.Future:
        """Queue `fn` for `run_commands`; the future resolves with its result or exception."""
        command = _Command(fn, concurrent.futures.Future(), when_idle)
        with self._lock:
            self._commands.append(command)
        self.wake.set()
        return command.result

    # ----- called from the scheduler thread -------------------------------------------------------

    def take_requests(self) -> list[RequestState]:
        """The requests submitted since the last call, in order."""
        with self._lock:
            arrived, self._inbox = self._inbox, []
        return arrived

    def run_commands(self, busy: Callable[[], bool]) -> bool:
        """Run due commands in order; a when_idle command waits while `busy()`. Returns True while
        a when_idle command still waits."""
        with self._lock:
            commands = list(self._commands)
        waiting_for_idle = False
        for command in commands:
            if command.when_idle and busy():
                waiting_for_idle = True
                continue
            with self._lock:
                self._commands.remove(command)
            try:
                command.result.set_result(command.fn())
            except Exception as exc:  # reported to the caller, the loop goes on
                command.result.set_exception(exc)
        return waiting_for_idle

    def is_live(self, rid: str) -> bool:
        """Whether a request with exactly this rid is queued or running."""
        with self._lock:
            return rid in self._rids

    def release(self, rid: str) -> None:
        """`rid` finished: a new request may use it again."""
        with self._lock:
            self._rids.discard(rid)
