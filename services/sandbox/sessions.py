"""Session registry: create (workspace + setup + snapshot), exec, kill, reset, delete, idle expiry.

One session = one workspace, one unprivileged uid (from this instance's locked uid block), one
cgroup, one policy, one task environment. Commands of a session run one at a time, in order;
commands of different sessions run concurrently up to `max_concurrent_execs`. How commands run
and processes die: processes.py; the session record: session.py; the uid block: uids.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from pathlib import Path

from services.sandbox import metrics
from services.sandbox.cgroups import CgroupSupport
from services.sandbox.executor import RawExec
from services.sandbox.isolation import Isolation, base_env, prepare_etc
from services.sandbox.limits import Limits
from services.sandbox.policy import Policy
from services.sandbox.processes import EXEC_MODES, SessionProcesses
from services.sandbox.runner_link import RunnerFailed
from services.sandbox.session import Session, SessionError
from services.sandbox.uids import UidPool
from services.sandbox.workspace import Workspace
from shellrl.contract.exec import ALLOW, ExecResult, PolicyVerdict

log = logging.getLogger(__name__)
WORKSPACE_TOKEN = "<workspace>"


def exec_result(raw: RawExec, policy: PolicyVerdict) -> ExecResult:
    """What POST /v1/sessions/{id}/exec returns for a command that ran."""
    return ExecResult(raw.stdout, raw.stderr, raw.exit_code, raw.timed_out, raw.stdout_truncated_bytes,
                      raw.stderr_truncated_bytes, round(raw.duration_ms, 3), policy)


class SessionManager:
    """The live sessions of this instance and every request about them (see module doc)."""

    def __init__(self, *, root: Path, isolation: Isolation, cgroups: CgroupSupport, uids: UidPool,
                 policies: dict[str, Policy], default_policy: str, default_limits: Limits, max_sessions: int,
                 session_ttl_s: float, setup_timeout_s: float, max_timeout_s: float, max_command_bytes: int,
                 max_concurrent_execs: int, exec_mode: str = "session") -> None:
        if exec_mode not in EXEC_MODES:
            raise ValueError(f"exec_mode must be one of {EXEC_MODES}, got {exec_mode!r}")
        self.root = Path(root)
        self.isolation, self.cgroups, self.uids = isolation, cgroups, uids
        self.policies, self.default_policy = policies, default_policy
        self.default_limits = default_limits
        self.max_sessions, self.session_ttl_s = max_sessions, session_ttl_s
        self.setup_timeout_s, self.max_timeout_s = setup_timeout_s, max_timeout_s
        self.max_command_bytes = max_command_bytes
        self.processes = SessionProcesses(isolation, exec_mode, max_concurrent_execs)
        self.sessions: dict[str, Session] = {}
        self._creating = 0

    # ---- lifecycle -------------------------------------------------------------------------
    def clean_stale(self) -> None:
        """Remove what a crashed instance with this uid block left: processes, cgroups, mounts."""
        for uid in self.uids.uids:
            group = self.cgroups.group(f"u{uid}")
            if group is not None and any(d.exists() for d in group.dirs.values()):
                group.remove()
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)
        for ancestor in self.root.parents:  # session uids must reach their workspace (bwrap binds run as them)
            if not os.stat(ancestor).st_mode & 0o001:
                raise ValueError(f"workspace_root: {ancestor} is not searchable by other users (mode o+x); "
                                 "choose a workspace_root below directories with o+x")
        for entry in self.root.iterdir():
            Workspace(entry, 0, 1 << 20).destroy()
        prepare_etc(self.root, self.uids.uids)
        self.processes.install_runtime(self.root / "runtime")

    async def close(self) -> None:
        for session_id in list(self.sessions):
            await self.delete(session_id)

    async def expire_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            now = time.time()
            for s in list(self.sessions.values()):
                if now - s.last_used_at > self.session_ttl_s and not s.lock.locked():
                    log.info("session expired", extra={"session_id": s.session_id})
                    metrics.SESSIONS_EXPIRED.inc()
                    await self.delete(s.session_id)

    # ---- requests --------------------------------------------------------------------------
    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.closed:
            raise SessionError(404, "session_not_found", f"no session {session_id!r} (expired or deleted?)",
                               "session_id")
        return session

    def _resolve_env(self, env: dict[str, str], workspace_path: str) -> dict[str, str]:
        out = base_env(workspace_path)
        for key, value in env.items():
            if not key or not (key[0].isalpha() or key[0] == "_") or not all(c.isalnum() or c == "_" for c in key):
                raise SessionError(400, "invalid_env", f"env name {key!r} is not a shell variable name", f"env.{key}")
            if "\x00" in value:
                raise SessionError(400, "invalid_env", f"env value of {key} contains a NUL byte", f"env.{key}")
            out[key] = value.replace(WORKSPACE_TOKEN, workspace_path)
        return out

    async def create(self, setup: str, env: dict[str, str], limits: Limits, policy_name: str | None
                     ) -> tuple[Session, ExecResult]:
        """New session with its setup script run; SessionError 400/429/422(setup_failed)."""
        policy = self.policies.get(policy_name or self.default_policy)
        if policy is None:
            raise SessionError(400, "unknown_policy", f"policy {policy_name!r} is not one of {sorted(self.policies)}",
                               "policy")
        if "\x00" in setup:
            raise SessionError(400, "invalid_setup", "setup contains a NUL byte", "setup")
        if len(self.sessions) + self._creating >= self.max_sessions:
            raise SessionError(429, "too_many_sessions",
                               f"{self.max_sessions} sessions are live (the cap); delete one or retry later")
        uid = self.uids.take()
        if uid is None:
            raise SessionError(429, "too_many_sessions", "no free sandbox uid; retry later")
        self._creating += 1
        start = time.perf_counter()
        session = None
        try:
            session_id = secrets.token_hex(8)
            workspace = Workspace(self.root / session_id, uid, limits.workspace_bytes)
            workspace_path = self.isolation.workspace_path(workspace.paths)
            session = Session(session_id, uid, workspace, self.cgroups.group(f"u{uid}"),
                              self._resolve_env(env, workspace_path), limits, policy, workspace_path)
            await asyncio.to_thread(self._prepare, session)
            self.sessions[session_id] = session
            if setup.strip():
                raw = await self.processes.run_per_command(session, setup, self.setup_timeout_s)
                result = exec_result(raw, ALLOW)
            else:
                result = ExecResult("", "", 0, False, 0, 0, 0.0, ALLOW)
            if result.exit_code != 0:
                raise SessionError(422, "setup_failed", f"setup exited with {result.exit_code}"
                                   + (" (timed out)" if result.timed_out else ""), "setup", result.as_dict())
            await asyncio.to_thread(self._snapshot, session)
            await self.processes.start_runner(session)
        except RunnerFailed as exc:
            metrics.SESSIONS_CREATED.labels("error").inc()
            await self._destroy(session)
            raise SessionError(503, "sandbox_unavailable", f"the session's sandbox did not start: {exc}") from None
        except BaseException as exc:
            metrics.SESSIONS_CREATED.labels("setup_failed" if isinstance(exc, SessionError) else "error").inc()
            if session is not None:
                await self._destroy(session)
            else:
                self.uids.give(uid)
            raise
        finally:
            self._creating -= 1
        metrics.SESSIONS_CREATED.labels("ok").inc()
        metrics.SESSIONS.set(len(self.sessions))
        metrics.SETUP_SECONDS.observe(time.perf_counter() - start)
        return session, result

    def _prepare(self, session: Session) -> None:
        session.workspace.create()
        if session.cgroup is not None:
            session.cgroup.create(session.uid, session.limits.pids, session.limits.memory_bytes)

    def _snapshot(self, session: Session) -> None:
        self.processes.kill_all(session, "setup_leftover")
        session.workspace.snapshot()

    async def exec(self, session_id: str, command: str, timeout_s: float | None, fresh_state: bool = False
                   ) -> ExecResult:
        """Run `command` in the session. `fresh_state`: in the session's environment as at creation
        (fresh_env) at the workspace root, reading nothing the session wrote (isolation.py)."""
        session = self.get(session_id)
        if "\x00" in command:
            raise SessionError(400, "invalid_command", "command contains a NUL byte (\\x00); remove it", "command")
        if len(command.encode("utf-8", errors="surrogatepass")) > self.max_command_bytes:
            raise SessionError(400, "invalid_command", f"command is longer than {self.max_command_bytes} bytes",
                               "command")
        if timeout_s is not None and timeout_s > self.max_timeout_s:
            raise SessionError(400, "invalid_timeout", f"timeout_s must be <= {self.max_timeout_s}", "timeout_s")
        # long commands are evaluated off the event loop (the regex engine releases the GIL)
        verdict = (session.policy.evaluate(command) if len(command) < 65536
                   else await asyncio.to_thread(session.policy.evaluate, command))
        metrics.POLICY_VERDICTS.labels(verdict.verdict, verdict.rule or "").inc()
        async with session.lock:
            if session.closed:
                raise SessionError(404, "session_not_found", f"session {session_id!r} was deleted", "session_id")
            session.commands += 1
            session.last_used_at = time.time()
            if verdict.verdict != "allow":
                session.safety_events.append({"rule": verdict.rule, "verdict": verdict.verdict,
                                              "command": command[:2000]})
            if verdict.verdict == "deny":
                return ExecResult("", f"sandbox: command denied by policy rule {verdict.rule!r}\n", None, False,
                                  0, 0, 0.0, verdict)
            raw = await self.processes.run(session, command, timeout_s or session.limits.timeout_s,
                                           fresh_state)
            session.last_used_at = time.time()
        metrics.EXEC_SECONDS.labels(self.isolation.layer).observe(raw.duration_ms / 1000.0)
        metrics.OUTPUT_TRUNCATED_BYTES.inc(raw.stdout_truncated_bytes + raw.stderr_truncated_bytes)
        if raw.timed_out:
            metrics.TIMEOUTS.inc()
        return exec_result(raw, verdict)

    async def kill_processes(self, session_id: str) -> float:
        """Kill every process of the session (background ones included) but keep its workspace,
        shell state and runner; returns the duration in ms."""
        session = self.get(session_id)
        async with session.lock:
            if session.closed:
                raise SessionError(404, "session_not_found", f"session {session_id!r} was deleted", "session_id")
            start = time.perf_counter()
            await self.processes.kill_processes(session, "kill_request")
            await self.processes.ensure_runner(session)
            session.last_used_at = time.time()
        return (time.perf_counter() - start) * 1000.0

    async def reset(self, session_id: str) -> float:
        """Restore the post-setup snapshot; returns the duration in ms."""
        session = self.get(session_id)
        async with session.lock:
            start = time.perf_counter()
            await self.processes.kill_processes(session, "reset")
            await asyncio.to_thread(session.workspace.reset)
            await self.processes.ensure_runner(session)
            session.last_used_at = time.time()
            duration_s = time.perf_counter() - start
        metrics.RESET_SECONDS.observe(duration_s)
        return duration_s * 1000.0

    async def delete(self, session_id: str) -> None:
        session = self.get(session_id)
        session.closed = True
        async with session.lock:
            await self._destroy(session)
        metrics.SESSIONS.set(len(self.sessions))

    async def _destroy(self, session: Session) -> None:
        session.closed = True
        self.sessions.pop(session.session_id, None)
        if session.runner is not None:
            await session.runner.stop()

        def destroy() -> None:
            self.processes.release(session)
            session.workspace.destroy()

        try:
            await asyncio.to_thread(destroy)
        finally:
            self.uids.give(session.uid)

