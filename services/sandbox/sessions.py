"""Session registry: create (workspace + setup + snapshot), exec, kill, reset, delete, idle expiry.

One session = one workspace, one unprivileged uid (from this instance's locked uid block), one
cgroup, one policy, one task environment. Commands of a session run one at a time, in order;
commands of different sessions run concurrently up to `max_concurrent_execs`.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.sandbox import metrics, seccomp
from services.sandbox.cgroups import CgroupSupport, SessionCgroup
from services.sandbox.executor import RawExec, kill_process_group, run_launch
from services.sandbox.isolation import Isolation, LaunchSpec, base_env, prepare_etc
from services.sandbox.limits import Limits
from services.sandbox.policy import Policy
from services.sandbox.runner_link import RunnerFailed, RunnerLink
from services.sandbox.workspace import Workspace
from shellrl.contract.exec import ALLOW, ExecResult, PolicyVerdict

log = logging.getLogger(__name__)
WORKSPACE_TOKEN = "<workspace>"
EXEC_MODES = ("session", "per_command")
RUNNER_SOURCE = Path(__file__).with_name("runner.py")


class SessionError(Exception):
    """A request about sessions that cannot be served; mapped to an HTTP error by app.py."""

    def __init__(self, status: int, code: str, message: str, field: str | None = None,
                 details: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.field, self.details = status, code, message, field, details


def exec_result(raw: RawExec, policy: PolicyVerdict) -> ExecResult:
    """What POST /v1/sessions/{id}/exec returns for a command that ran."""
    return ExecResult(raw.stdout, raw.stderr, raw.exit_code, raw.timed_out, raw.stdout_truncated_bytes,
                      raw.stderr_truncated_bytes, round(raw.duration_ms, 3), policy)


@dataclass
class Session:
    session_id: str
    uid: int
    workspace: Workspace
    cgroup: SessionCgroup | None
    env: dict[str, str]
    limits: Limits
    policy: Policy
    workspace_path: str
    created_at: float = field(default_factory=time.time)
    last_used_at: float = field(default_factory=time.time)
    commands: int = 0
    safety_events: list[dict] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False
    runner: RunnerLink | None = None
    runner_restarts: int = 0

    def info(self, isolation: str) -> dict:
        return {"session_id": self.session_id, "isolation": isolation, "workspace": self.workspace_path, "uid": self.uid,
                "policy": self.policy.name, "commands": self.commands, "safety_events": list(self.safety_events),
                "runner_restarts": self.runner_restarts, "limits": self.limits.as_dict(), "created_at": self.created_at, "last_used_at": self.last_used_at}


class UidPool:
    """A block of uids owned by this instance (flock on a lock file) handed out one per session.

    The last uid of the block is reserved for start-up probes. Blocks keep several sandbox
    instances on one machine from sharing uids (and so cgroups and kill sweeps).
    """

    def __init__(self, uid_base: int, block_size: int, max_blocks: int = 256) -> None:
        lock_dir = Path(tempfile.gettempdir()) / "shellrl-sandbox-locks"
        lock_dir.mkdir(mode=0o755, exist_ok=True)
        for block in range(max_blocks):
            fd = os.open(lock_dir / f"uid-block-{uid_base}-{block}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._lock_fd, self.block = fd, block
            self.first = uid_base + block * block_size
            self.probe_uid = self.first + block_size - 1
            self._free = list(range(self.first + block_size - 2, self.first - 1, -1))
            return
        raise RuntimeError(f"all {max_blocks} sandbox uid blocks from {uid_base} are locked by other instances")

    @property
    def uids(self) -> range:
        return range(self.first, self.probe_uid + 1)

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, uid: int) -> None:
        self._free.append(uid)


def kill_uid(uid: int) -> None:
    """SIGKILL every process of `uid` (kill(-1) sent as that uid): catches setsid/double-fork."""
    subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", "/usr/bin/kill", "-9", "-1"],
                   env={"PATH": "/usr/bin:/bin"}, cwd="/",
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10,
                   check=False)


class SessionManager:
    def __init__(self, *, root: Path, isolation: Isolation, cgroups: CgroupSupport, uids: UidPool,
                 policies: dict[str, Policy], default_policy: str, default_limits: Limits, max_sessions: int,
                 session_ttl_s: float, setup_timeout_s: float, max_timeout_s: float, max_command_bytes: int,
                 max_concurrent_execs: int, exec_mode: str = "session") -> None:
        if exec_mode not in EXEC_MODES:
            raise ValueError(f"exec_mode must be one of {EXEC_MODES}, got {exec_mode!r}")
        self.exec_mode = exec_mode
        self.root = Path(root)
        self.isolation, self.cgroups, self.uids = isolation, cgroups, uids
        self.policies, self.default_policy = policies, default_policy
        self.default_limits = default_limits
        self.max_sessions, self.session_ttl_s = max_sessions, session_ttl_s
        self.setup_timeout_s, self.max_timeout_s = setup_timeout_s, max_timeout_s
        self.max_command_bytes = max_command_bytes
        self.exec_slots = asyncio.Semaphore(max_concurrent_execs)
        self.sessions: dict[str, Session] = {}
        self._creating = 0
        self.is_root = os.geteuid() == 0

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
        runtime = self.root / "runtime"
        runtime.mkdir(mode=0o755)
        self.runner_file = runtime / "runner.py"
        shutil.copyfile(RUNNER_SOURCE, self.runner_file)
        os.chmod(self.runner_file, 0o644)
        program = seccomp.denylist_program()
        if self.isolation.layer == "bubblewrap" and program is not None:
            (runtime / "seccomp.bpf").write_bytes(program)
            self.isolation.seccomp_path = runtime / "seccomp.bpf"
        elif self.isolation.layer == "bubblewrap":
            log.warning("no seccomp filter for this architecture; bubblewrap runs without one")

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
                raw = await self._run_per_command(session, setup, self.setup_timeout_s)
                result = exec_result(raw, ALLOW)
            else:
                result = ExecResult("", "", 0, False, 0, 0, 0.0, ALLOW)
            if result.exit_code != 0:
                raise SessionError(422, "setup_failed", f"setup exited with {result.exit_code}"
                                   + (" (timed out)" if result.timed_out else ""), "setup", result.as_dict())
            await asyncio.to_thread(self._snapshot, session)
            await self._start_runner(session)
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
        self._kill_all(session, "setup_leftover")
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
            raw = await self._run(session, command, timeout_s or session.limits.timeout_s, fresh_state)
            session.last_used_at = time.time()
        metrics.EXEC_SECONDS.labels(self.isolation.layer).observe(raw.duration_ms / 1000.0)
        metrics.OUTPUT_TRUNCATED_BYTES.inc(raw.stdout_truncated_bytes + raw.stderr_truncated_bytes)
        if raw.timed_out:
            metrics.TIMEOUTS.inc()
        return exec_result(raw, verdict)

    def _spec(self, session: Session) -> LaunchSpec:
        return LaunchSpec(session.workspace.paths, session.uid, session.env, session.limits, session.policy.network,
                          tuple(session.cgroup.procs_files) if session.cgroup else (), self.runner_file)

    async def _run(self, session: Session, command: str, timeout_s: float, fresh_state: bool = False) -> RawExec:
        if self.exec_mode == "per_command":
            return await self._run_per_command(session, command, timeout_s, fresh_state)
        data = command.encode("utf-8", errors="surrogateescape")
        start = time.perf_counter()
        async with self.exec_slots:
            if session.runner is None or not session.runner.alive:
                await self._restart_runner(session)
            try:
                return await session.runner.exec(data, timeout_s, session.limits.max_output_bytes, fresh_state)
            except RunnerFailed as exc:
                log.warning("session runner failed; restarting it", extra={"session_id": session.session_id,
                                                                           "error": str(exc)})
                await self._restart_runner(session)
                note = (f"sandbox: {exc}; every process of the session was killed and the session restarted"
                        " (workspace kept)\n")
                return RawExec("", note, 124 if exc.hung else 137, exc.hung, 0, 0, (time.perf_counter() - start) * 1e3)

    async def _run_per_command(self, session: Session, command: str, timeout_s: float, fresh_state: bool = False
                               ) -> RawExec:
        session.workspace.paths.command_file.write_bytes(command.encode("utf-8", errors="surrogateescape"))
        launch = self.isolation.command(self._spec(session), fresh_state)
        async with self.exec_slots:
            return await run_launch(launch, timeout_s, session.limits.max_output_bytes,
                                    lambda pid: self._kill_tree(session, pid))

    async def _start_runner(self, session: Session) -> None:
        if self.exec_mode != "session":
            return
        launch, prelude, fresh_prelude = self.isolation.runner(self._spec(session))
        runner = RunnerLink(launch)
        await runner.start(prelude, fresh_prelude)
        session.runner = runner

    async def _stop_runner(self, session: Session) -> None:
        if session.runner is not None:
            runner, session.runner = session.runner, None
            await runner.stop()
        self._kill_all(session, "runner_stop")

    async def _restart_runner(self, session: Session) -> None:
        await self._stop_runner(session)
        session.runner_restarts += 1
        await self._start_runner(session)

    def _kill_tree(self, session: Session, pid: int) -> None:
        kill_process_group(pid)
        self._kill_all(session, "tree")

    def _kill_all(self, session: Session, reason: str) -> None:
        """Every process of the session: the cgroup where there is one, else the session uid."""
        if session.cgroup is not None:
            sent = session.cgroup.kill_all()
            if sent:
                metrics.KILLS.labels(reason).inc(sent)
        elif self.is_root:
            kill_uid(session.uid)

    async def kill_processes(self, session_id: str) -> float:
        """Kill every process of the session (background ones included) but keep its workspace,
        shell state and runner; returns the duration in ms."""
        session = self.get(session_id)
        async with session.lock:
            if session.closed:
                raise SessionError(404, "session_not_found", f"session {session_id!r} was deleted", "session_id")
            start = time.perf_counter()
            await self._kill_processes(session, "kill_request")
            if self.exec_mode == "session" and (session.runner is None or not session.runner.alive):
                await self._restart_runner(session)
            session.last_used_at = time.time()
        return (time.perf_counter() - start) * 1000.0

    async def _kill_processes(self, session: Session, reason: str) -> None:
        """Every process of the session but its runner dies (the runner too if it fails to confirm)."""
        if session.runner is not None and session.runner.alive:
            try:
                await session.runner.kill_all()  # keeps the runner: no sandbox restart
            except RunnerFailed:
                await self._stop_runner(session)
        if session.cgroup is not None:
            self._kill_all(session, reason)  # the runner is not in the cgroup
        elif session.runner is None:
            self._kill_all(session, reason)

    async def reset(self, session_id: str) -> float:
        """Restore the post-setup snapshot; returns the duration in ms."""
        session = self.get(session_id)
        async with session.lock:
            start = time.perf_counter()
            await self._kill_processes(session, "reset")
            await asyncio.to_thread(session.workspace.reset)
            if self.exec_mode == "session" and (session.runner is None or not session.runner.alive):
                await self._restart_runner(session)
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
            if session.cgroup is not None:
                session.cgroup.remove()
            elif self.is_root:
                kill_uid(session.uid)
            session.workspace.destroy()

        try:
            await asyncio.to_thread(destroy)
        finally:
            self.uids.give(session.uid)

