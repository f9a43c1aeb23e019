"""Session registry: create (workspace + setup + snapshot), exec, kill, reset, delete, idle expiry.

One session = one workspace, one unprivileged uid (from this instance's locked uid block), one
cgroup, one policy, one task environment. Commands of a session run one at a time, in order;
commands of different sessions run concurrently up to `max_concurrent_execs`, slots handed out
fairly (execution/slots.py). Text fields (command, setup, env) must be valid Unicode without NUL
bytes, and the task environment at most `MAX_ENV_BYTES` (shellrl/contract/tasks.py): else 400 naming
the field. New sessions and commands are admitted by the host's headroom (admission.py: 429 with
Retry-After). How commands run and processes die: processes.py; the session record: session.py; the
uid block: host/uids.py; the checks of what a session is given (text fields, the environment):
session_input.py. A session's host directory is named by its uid, not its id, so the id never shows
in a path a command can see (the workspace path of unshare/fallback, mountinfo).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path

from services.sandbox import metrics
from services.sandbox.cgroups.support import CgroupSupport
from services.sandbox.egress.doors import (
    IN_SANDBOX_SOCKET,
    SOCKET_NAME,
    EgressDoors,
    proxy_env,
    unavailable_reason,
)
from services.sandbox.egress.proxy import EgressState
from services.sandbox.execution.executor import RawExec
from services.sandbox.execution.runner_link import RunnerFailed
from services.sandbox.host import uids as host_uids
from services.sandbox.host.uids import UidPool, remove_ipc_objects, remove_owned
from services.sandbox.isolation import argv_trace
from services.sandbox.isolation.layers import Isolation, prepare_etc
from services.sandbox.limits import Limits
from services.sandbox.policy import Policy
from services.sandbox.sessions.admission import Admission
from services.sandbox.sessions.processes import EXEC_MODES, SessionProcesses
from services.sandbox.sessions.session import Session, SessionError
from services.sandbox.sessions.session_input import check_text, session_env
from services.sandbox.workspace.files import Workspace
from shellrl.contract.exec import ALLOW, ExecResult, PolicyVerdict

log = logging.getLogger(__name__)


def exec_result(raw: RawExec, policy: PolicyVerdict, waited_ms: float = 0.0) -> ExecResult:
    """What POST /v1/sessions/{id}/exec returns for a command that ran; `waited_ms` is added to
    the slot wait in `raw.queue_ms` (the wait for the session's earlier commands)."""
    return ExecResult(
        raw.stdout,
        raw.stderr,
        raw.exit_code,
        raw.timed_out,
        raw.stdout_truncated_bytes,
        raw.stderr_truncated_bytes,
        round(raw.duration_ms, 3),
        policy,
        round(raw.queue_ms + waited_ms, 3),
    )


class SessionManager:
    """The live sessions of this instance and every request about them (see module doc)."""

    def __init__(
        self,
        *,
        root: Path,
        isolation: Isolation,
        cgroups: CgroupSupport,
        uids: UidPool,
        policies: dict[str, Policy],
        default_policy: str,
        default_limits: Limits,
        max_sessions: int,
        session_ttl_s: float,
        setup_timeout_s: float,
        max_timeout_s: float,
        max_command_bytes: int,
        max_concurrent_execs: int,
        admission: Admission,
        exec_mode: str = "session",
        egress: EgressDoors | None = None,
    ) -> None:
        if exec_mode not in EXEC_MODES:
            raise ValueError(f"exec_mode must be one of {EXEC_MODES}, got {exec_mode!r}")
        self.root = Path(root)
        self.isolation, self.cgroups, self.uids = isolation, cgroups, uids
        self.admission = admission
        self.policies, self.default_policy = policies, default_policy
        self.default_limits = default_limits
        self.max_sessions, self.session_ttl_s = max_sessions, session_ttl_s
        self.setup_timeout_s, self.max_timeout_s = setup_timeout_s, max_timeout_s
        self.max_command_bytes = max_command_bytes
        self.processes = SessionProcesses(isolation, exec_mode, max_concurrent_execs)
        self.egress = self.processes.egress = egress
        self.sessions: dict[str, Session] = {}
        self._creating = 0
        # called with each exec's overhead (s): arrival to result minus run time (host/health.py)
        self.on_exec_overhead: Callable[[float], None] | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def clean_stale(self) -> None:
        """Remove what a crashed instance with this uid block left: processes (by cgroup, then by
        uid: an orphan sandbox not yet in its session's groups, known_pitfalls D06), cgroups, mounts."""
        for uid in self.uids.uids:  # the current layout was swept when the parent was set up
            for group in (self.cgroups.group(f"u{uid}"), self.cgroups.legacy_group(f"u{uid}")):
                if group is not None and group.exists():
                    group.remove()
        if left := host_uids.kill_uids_until_none(self.uids.uids):
            log.warning("killed what a crashed instance left", extra={"pids": left})
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o711)
        for (
            ancestor
        ) in self.root.parents:  # session uids must reach their workspace (bwrap binds run as them)
            if not os.stat(ancestor).st_mode & 0o001:
                raise ValueError(
                    f"workspace_root: {ancestor} is not searchable by other users (mode o+x); "
                    "choose a workspace_root below directories with o+x"
                )
        for entry in self.root.iterdir():
            Workspace(entry, 0, 1 << 20).destroy()
        self._clean_host(self.uids.uids)
        prepare_etc(self.root, self.uids.uids)
        self.processes.install_runtime(self.root / "runtime")

    async def close(self) -> None:
        """Delete every session, then the instance's parent cgroup (at shutdown)."""
        for session_id in list(self.sessions):
            await self.delete(session_id)
        if self.egress is not None:
            await self.egress.proxy.audit.close()
        await asyncio.to_thread(self.cgroups.remove)

    async def expire_loop(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            now = time.time()
            for s in list(self.sessions.values()):
                if now - s.last_used_at > self.session_ttl_s and not s.lock.locked():
                    log.info("session expired", extra={"session_id": s.session_id})
                    metrics.SESSIONS_EXPIRED.inc()
                    await self.delete(s.session_id)

    def headroom(self) -> dict:
        """What is free for sessions now (admission.py), for /readyz."""
        return self.admission.headroom(len(self.sessions) + self._creating).as_dict()

    # ---- requests --------------------------------------------------------------------------
    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.closed:
            raise SessionError(
                404,
                "session_not_found",
                f"no session {session_id!r} (expired or deleted?)",
                "session_id",
            )
        return session

    async def create(
        self, setup: str, env: dict[str, str], limits: Limits, policy_name: str | None
    ) -> tuple[Session, ExecResult]:
        """New session with its setup script run; SessionError 400/429/422(setup_failed). Its
        CPU quota is at most that of all sessions together (`limits.cpus` lowered to it)."""
        policy = self._policy(policy_name)
        check_text(setup, "setup", "invalid_setup")
        self.admission.admit_session(len(self.sessions) + self._creating, limits.pids)
        if self.cgroups.available:
            limits = replace(limits, cpus=min(limits.cpus, self.cgroups.limits.cpus))
        uid = self.uids.take()
        if uid is None:
            raise SessionError(
                429,
                "too_many_sessions",
                "no free sandbox uid; retry later",
                retry_after_s=self.admission.retry_after_s,
            )
        self._creating += 1
        start = time.perf_counter()
        session = None
        try:
            session = self._new_session(uid, env, limits, policy)
            await asyncio.to_thread(self._prepare, session)
            self.sessions[session.session_id] = session
            if policy.egress is not None:
                session.egress = EgressState(
                    session.session_id,
                    policy.egress,
                    lambda event: session.safety_events.append(event),
                )
                await self.egress.open(session.egress, session.egress_socket, uid)
            result = await self._run_setup(session, setup)
            await self.processes.start_runner(session)
        except RunnerFailed as exc:
            metrics.SESSIONS_CREATED.labels("error").inc()
            await self._destroy(session)
            raise SessionError(
                503, "sandbox_unavailable", f"the session's sandbox did not start: {exc}"
            ) from None
        except BaseException as exc:
            metrics.SESSIONS_CREATED.labels(
                "setup_failed" if isinstance(exc, SessionError) else "error"
            ).inc()
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

    def _policy(self, policy_name: str | None) -> Policy:
        """The named policy (None: the default); SessionError 400 when there is none, or when it
        has egress rules this host cannot serve."""
        policy = self.policies.get(policy_name or self.default_policy)
        if policy is None:
            raise SessionError(
                400,
                "unknown_policy",
                f"policy {policy_name!r} is not one of {sorted(self.policies)}",
                "policy",
            )
        if policy.egress is not None and (
            why := unavailable_reason(self.isolation.layer, self.egress)
        ):
            raise SessionError(
                400,
                "egress_unavailable",
                f"policy {policy.name!r} has egress rules: {why}",
                "policy",
            )
        return policy

    def _new_session(
        self, uid: int, env: dict[str, str], limits: Limits, policy: Policy
    ) -> Session:
        """The session's record (nothing created on the host yet), with the proxy environment
        when its policy has egress rules (egress/doors.py: the socket, and the proxy env)."""
        workspace = Workspace(self.root / f"u{uid}", uid, limits.workspace_bytes)
        workspace_path = self.isolation.workspace_path(workspace.paths)
        session = Session(
            secrets.token_hex(8),
            uid,
            workspace,
            self.cgroups.group(f"u{uid}"),
            session_env(env, workspace_path),
            limits,
            policy,
            workspace_path,
        )
        if policy.egress is not None:
            session.egress_socket = workspace.paths.ctl / SOCKET_NAME
            inside = str(session.egress_socket)
            if self.isolation.layer == "bubblewrap":
                inside = IN_SANDBOX_SOCKET
            tcp = self.processes.exec_mode == "session"
            session.env.update(proxy_env(inside, tcp))
        return session

    async def _run_setup(self, session: Session, setup: str) -> ExecResult:
        """Run the setup script and snapshot the workspace after it; SessionError 422
        (setup_failed, workspace_too_large)."""
        if setup.strip():
            raw = await self.processes.run_per_command(session, setup, self.setup_timeout_s)
            result = exec_result(raw, ALLOW)
        else:
            result = ExecResult("", "", 0, False, 0, 0, 0.0, ALLOW)
        if result.exit_code != 0:
            raise SessionError(
                422,
                "setup_failed",
                f"setup exited with {result.exit_code}"
                + (" (timed out)" if result.timed_out else ""),
                "setup",
                result.as_dict(),
            )
        try:
            await asyncio.to_thread(self._snapshot, session)
        except OSError as exc:  # copy_tree keeps links and holes: not expected, but a 4xx
            if exc.errno != errno.ENOSPC:
                raise
            message = "the workspace after setup does not fit into its copy (workspace_bytes)"
            raise SessionError(422, "workspace_too_large", message, "setup") from None
        return result

    def _prepare(self, session: Session) -> None:
        session.workspace.create()
        self.isolation.prepare_session(session.workspace.paths, session.limits.memory_bytes)
        if session.cgroup is not None:
            limits = session.limits
            session.cgroup.create(
                session.uid,
                self.cgroups.session_limits(limits.memory_bytes, limits.pids, limits.cpus),
            )

    def _snapshot(self, session: Session) -> None:
        self.processes.kill_all(session, "setup_leftover")
        session.workspace.snapshot()
        self._clean_host((session.uid,))

    def _reset_files(self, session: Session) -> None:
        session.workspace.reset()
        self._clean_host((session.uid,))

    def _clean_host(self, uids: Collection[int]) -> None:
        """What `uids` left outside the session's mounts where the layer shares the host's:
        files in world-writable directories, SysV IPC objects (fallback: no IPC namespace)."""
        remove_owned(self.isolation.host_shared_dirs, uids)
        if self.isolation.layer == "fallback":
            remove_ipc_objects(uids)

    async def exec(
        self, session_id: str, command: str, timeout_s: float | None, fresh_state: bool = False
    ) -> ExecResult:
        """Run `command` in the session. `fresh_state`: in the session's environment as at creation
        (fresh_env) at the workspace root, reading nothing the session wrote
        (isolation/preludes.py)."""
        received = time.perf_counter()
        session = self.get(session_id)
        check_text(command, "command", "invalid_command")
        if len(command.encode("utf-8")) > self.max_command_bytes:
            raise SessionError(
                400,
                "invalid_command",
                f"command is longer than {self.max_command_bytes} bytes",
                "command",
            )
        if timeout_s is not None and timeout_s > self.max_timeout_s:
            raise SessionError(
                400, "invalid_timeout", f"timeout_s must be <= {self.max_timeout_s}", "timeout_s"
            )
        self.admission.admit_exec(len(self.sessions))
        # off the event loop, always (linear, ~1 ms per rule for 64 KiB; RE2 releases the GIL)
        verdict = await asyncio.to_thread(session.policy.evaluate, command)
        metrics.POLICY_VERDICTS.labels(verdict.verdict, verdict.rule or "").inc()
        arrived = time.perf_counter()
        async with session.lock:
            waited_ms = (time.perf_counter() - arrived) * 1e3
            if session.closed:
                raise SessionError(
                    404, "session_not_found", f"session {session_id!r} was deleted", "session_id"
                )
            session.commands += 1
            session.last_used_at = time.time()
            if verdict.verdict != "allow":
                session.safety_events.append(
                    {"rule": verdict.rule, "verdict": verdict.verdict, "command": command[:2000]}
                )
            if verdict.verdict == "deny":
                return ExecResult(
                    "",
                    f"sandbox: command denied by policy rule {verdict.rule!r}\n",
                    None,
                    False,
                    0,
                    0,
                    0.0,
                    verdict,
                    round(waited_ms, 3),
                )
            raw = await self.processes.run(
                session, command, timeout_s or session.limits.timeout_s, fresh_state
            )
            session.last_used_at = time.time()
            if not fresh_state:  # what its shell ran, expanded (isolation/argv_trace.py)
                session.safety_events += await asyncio.to_thread(
                    argv_trace.session_events, session, verdict, raw.timed_out
                )
        result = exec_result(raw, verdict, waited_ms)
        metrics.EXEC_SECONDS.labels(self.isolation.layer).observe(raw.duration_ms / 1000.0)
        metrics.EXEC_QUEUE_SECONDS.labels(self.isolation.layer).observe(result.queue_ms / 1000.0)
        metrics.OUTPUT_TRUNCATED_BYTES.inc(raw.stdout_truncated_bytes + raw.stderr_truncated_bytes)
        if raw.timed_out:
            metrics.TIMEOUTS.inc()
        if self.on_exec_overhead is not None:
            self.on_exec_overhead(time.perf_counter() - received - raw.duration_ms / 1000.0)
        return result

    async def kill_processes(self, session_id: str) -> float:
        """Kill every process of the session (background ones included) but keep its workspace,
        shell state and runner; returns the duration in ms."""
        session = self.get(session_id)
        async with session.lock:
            if session.closed:
                raise SessionError(
                    404, "session_not_found", f"session {session_id!r} was deleted", "session_id"
                )
            start = time.perf_counter()
            await self.processes.kill_processes(session, "kill_request")
            await self.processes.ensure_runner(session)
            session.last_used_at = time.time()
        return (time.perf_counter() - start) * 1000.0

    async def reset(self, session_id: str) -> float:
        """Restore the state right after setup: every process of the session but its runner
        ends, the session's SysV IPC objects (shared memory, semaphores, message queues) are
        removed, every writable path is wiped and the workspace copied back. Returns the
        duration in ms."""
        session = self.get(session_id)
        async with session.lock:
            start = time.perf_counter()
            await self.processes.kill_processes(session, "reset", remove_ipc=True)
            await asyncio.to_thread(self._reset_files, session)
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
        self.processes.exec_slots.forget(session.session_id)
        if self.egress is not None:
            await self.egress.close(session.session_id)
        if session.runner is not None:
            await session.runner.stop()

        def destroy() -> None:
            self.processes.release(session)
            session.workspace.destroy()
            self._clean_host((session.uid,))

        try:
            await asyncio.to_thread(destroy)
        finally:
            self.uids.give(session.uid)
