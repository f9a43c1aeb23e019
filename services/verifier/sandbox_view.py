"""The episode's workspace as the checks see it, over the sandbox API (shellrl.clients.sandbox).

* Check commands run in the episode's session, but never in the agent's shell state: the sandbox
  replays the cwd and exported variables the agent left (agents expect `cd` and `export` to
  persist) from files the agent can write, so checks run with the sandbox's `fresh_state` exec:
  a bash that reads no startup file and no saved state, the session's environment as at creation
  (the sandbox's fixed variables plus the task's `env`), PATH fixed to the system directories,
  cwd = the workspace root. The agent's saved state is not rewritten by checks either.
* No process of the session is alive when a check starts: `prepare()` kills the agent's leftover
  (background) processes, and every check command is followed by another kill, so nothing can
  rewrite files between checks or tamper with a later check command (ptrace, /proc/<pid>/fd).
* Files are read by the sandbox's host side (openat2 RESOLVE_BENEATH): symlinks that stay inside
  the workspace are followed, anything leaving it is refused (403), so is a non-regular file.
* `reference_command` runs in a fresh session with the task's setup (the post-setup state), once
  per (setup, env, command): outputs are cached, and concurrent lookups share one run. Creating
  that session waits while the sandbox is at its session cap (429): `BUSY_ATTEMPTS` attempts,
  0.1 s doubling between them (tenacity).

Not to be confused with services/sandbox/workspace/files.py (the sandbox's own per-session directory):
this module is the verifier's view of a session, through the sandbox's HTTP API.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict

from services.verifier import metrics
from services.verifier.workspace_checks import (
    CheckInfraError,
    CommandOutput,
    FileRefused,
    FileTooLarge,
)
from shellrl.clients.sandbox import (
    ExecResult,
    SandboxBusy,
    SandboxError,
    SandboxNotFound,
    SandboxSetupFailed,
)
from shellrl.contract import Task

BUSY_ATTEMPTS = 6  # session creations tried while the sandbox answers 429
BUSY_MAX_POLL_S = 10.0  # the waits between them: 0.1 s doubling (1.6 s before the sixth)


def command_output(result: ExecResult) -> CommandOutput:
    return CommandOutput(
        result.stdout,
        result.exit_code,
        result.timed_out,
        result.stdout_truncated_bytes,
        result.policy.verdict,
    )


def _session_gone(exc: SandboxError) -> bool:
    return isinstance(exc, SandboxNotFound) and exc.code != "file_not_found"


class SandboxWorkspace:
    """One episode's session. `prepare()` must be called first (it reads the session's workspace
    path and safety events, before any check command can add its own)."""

    def __init__(
        self, sandbox, session_id: str, task: Task, reference_cache: ReferenceCache
    ) -> None:
        self.sandbox, self.session_id, self.task, self.reference_cache = (
            sandbox,
            session_id,
            task,
            reference_cache,
        )
        self.workspace_path: str | None = None
        self.safety_events: list[dict] = []
        self.diff: dict | None = None

    async def prepare(self, read_diff: bool = False) -> None:
        """Read the session (workspace path, safety events), then kill its processes; with
        `read_diff`, then read its diff against the post-setup snapshot (`self.diff`: before any
        check command can change the workspace). Raises CheckInfraError when the session is gone
        or the sandbox cannot answer."""
        try:
            info = await self.sandbox.session_info(self.session_id)
        except SandboxError as exc:
            gone = (
                "is gone (expired, deleted or never existed)"
                if _session_gone(exc)
                else f"cannot be read: {exc}"
            )
            raise CheckInfraError(f"sandbox session {self.session_id} {gone}") from None
        self.workspace_path = info["workspace"]
        self.safety_events = [e for e in info.get("safety_events", []) if isinstance(e, dict)]
        await self._kill_processes()
        if read_diff:
            try:
                self.diff = await self.sandbox.diff(self.session_id)
            except SandboxError as exc:
                raise CheckInfraError(
                    f"reading the diff of session {self.session_id} failed: {exc}"
                ) from None

    async def _kill_processes(self) -> None:
        try:
            await self.sandbox.kill_processes(self.session_id)
        except SandboxError as exc:
            raise CheckInfraError(
                f"killing the processes of session {self.session_id} failed: {exc}"
            ) from None

    async def run(self, command: str, timeout_s: float) -> CommandOutput:
        try:
            result = await self.sandbox.exec(
                self.session_id, command, timeout_s=timeout_s, fresh_state=True
            )
        except SandboxError as exc:
            raise CheckInfraError(f"exec in session {self.session_id} failed: {exc}") from None
        await self._kill_processes()  # whatever the check command left running
        return command_output(result)

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        try:
            return await self.sandbox.read_file(self.session_id, path, max_bytes=max_bytes)
        except SandboxError as exc:
            if exc.status == 413:
                raise FileTooLarge(f"larger than max_file_bytes={max_bytes}") from None
            if exc.status in (400, 403) or exc.code == "file_not_found":
                raise FileRefused((exc.body.get("error") or {}).get("message", str(exc))) from None
            raise CheckInfraError(
                f"reading {path!r} from session {self.session_id} failed: {exc}"
            ) from None

    async def run_reference(self, command: str, timeout_s: float) -> CommandOutput:
        return await self.reference_cache.output(self.task, command, timeout_s)


class ReferenceCache:
    """Outputs of reference commands, keyed by sha256(setup, env, command); LRU of `size` entries."""

    def __init__(self, sandbox, size: int = 1024) -> None:
        self.sandbox, self.size = sandbox, size
        self._done: OrderedDict[str, CommandOutput] = OrderedDict()
        self._running: dict[str, asyncio.Future] = {}

    @staticmethod
    def key(task: Task, command: str) -> str:
        return hashlib.sha256(
            json.dumps([task.setup, sorted(task.env.items()), command]).encode()
        ).hexdigest()

    async def output(self, task: Task, command: str, timeout_s: float) -> CommandOutput:
        """The reference command's output in a fresh post-setup workspace. Raises CheckInfraError."""
        key = self.key(task, command)
        if key in self._done:
            self._done.move_to_end(key)
            metrics.REFERENCE_RUNS.labels("hit").inc()
            return self._done[key]
        if key in self._running:
            return await asyncio.shield(self._running[key])
        future = asyncio.get_running_loop().create_future()
        self._running[key] = future
        try:
            out = await self._run(task, command, timeout_s)
        except BaseException as exc:
            future.set_exception(
                exc if isinstance(exc, Exception) else CheckInfraError("cancelled")
            )
            future.exception()  # mark retrieved: waiters re-raise it
            raise
        finally:
            self._running.pop(key, None)
        future.set_result(out)
        metrics.REFERENCE_RUNS.labels("run").inc()
        if self.size and not (out.timed_out or out.policy_verdict == "deny"):
            self._done[key] = out
            while len(self._done) > self.size:
                self._done.popitem(last=False)
        return out

    async def _run(self, task: Task, command: str, timeout_s: float) -> CommandOutput:
        session = await self._create(task)
        try:
            return command_output(
                await self.sandbox.exec(
                    session["session_id"], command, timeout_s=timeout_s, fresh_state=True
                )
            )
        except SandboxError as exc:
            raise CheckInfraError(f"reference command failed to run: {exc}") from None
        finally:
            try:
                await self.sandbox.delete(session["session_id"])
            except SandboxError:
                pass  # the sandbox's idle TTL removes it

    async def _create(self, task: Task) -> dict:
        try:
            session, _ = await self.sandbox.create_session_when_free(
                poll_s=0.1,
                max_poll_s=BUSY_MAX_POLL_S,
                attempts=BUSY_ATTEMPTS,
                setup=task.setup,
                env=dict(task.env),
            )
            return session
        except SandboxBusy:
            raise CheckInfraError("the sandbox stayed at its session cap (429)") from None
        except SandboxSetupFailed as exc:
            raise CheckInfraError(f"the task's setup failed in a fresh session: {exc}") from None
        except SandboxError as exc:
            raise CheckInfraError(
                f"cannot create a session for the reference command: {exc}"
            ) from None
