"""How a session's commands run and how its processes die.

exec_mode=session: one long-lived sandbox per session with the runner (runner.py) inside, a fresh
bash per command over its pipes (execution/runner_link.py); exec_mode=per_command: a fresh sandbox
per command (execution/executor.py). Kills go through the session's cgroup where there is one, else
through its uid. Commands of all sessions together run at most `max_concurrent_execs` at once, the
slots handed out fairly between sessions (execution/slots.py); the wait is reported as
`RawExec.queue_ms`.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

from services.sandbox import metrics
from services.sandbox.execution.executor import RawExec, kill_process_group, run_launch
from services.sandbox.execution.runner_link import RUNNER_SOURCE, RunnerFailed, RunnerLink
from services.sandbox.execution.slots import FairSlots
from services.sandbox.host import mounts
from services.sandbox.host.uids import kill_uid
from services.sandbox.isolation import seccomp
from services.sandbox.isolation.launch import LaunchSpec
from services.sandbox.isolation.layers import Isolation
from services.sandbox.sessions.session import Session

log = logging.getLogger(__name__)
EXEC_MODES = ("session", "per_command")


class SessionProcesses:
    """Starts, runs and kills the processes of sessions in one isolation layer and exec mode."""

    def __init__(self, isolation: Isolation, exec_mode: str, max_concurrent_execs: int) -> None:
        self.isolation, self.exec_mode = isolation, exec_mode
        self.exec_slots = FairSlots(max_concurrent_execs)
        self.is_root = os.geteuid() == 0
        self.runner_file: Path | None = None
        self.egress = None  # EgressDoors (egress/doors.py) when the service serves egress

    def install_runtime(self, runtime: Path) -> None:
        """Create `runtime` (a small tmpfs, 0755: bound into sandboxes, it names no host path)
        with a copy of the runner, the neutral /proc/loadavg and, for bubblewrap, the seccomp
        filter (`isolation.seccomp_path` set to it)."""
        runtime.mkdir(mode=0o755)
        mounts.mount(
            "tmpfs", runtime, "tmpfs", mounts.MS_NOSUID | mounts.MS_NODEV, "size=1m,mode=0755"
        )
        self.isolation.install_proc_files(runtime)
        self.runner_file = runtime / "runner.py"
        shutil.copyfile(RUNNER_SOURCE, self.runner_file)
        os.chmod(self.runner_file, 0o644)
        program = seccomp.denylist_program()
        if self.isolation.layer == "bubblewrap" and program is not None:
            (runtime / "seccomp.bpf").write_bytes(program)
            self.isolation.seccomp_path = runtime / "seccomp.bpf"
        elif self.isolation.layer == "bubblewrap":
            log.warning("no seccomp filter for this architecture; bubblewrap runs without one")

    def _spec(self, session: Session) -> LaunchSpec:
        cgroup_procs = tuple(session.cgroup.procs_files) if session.cgroup else ()
        return LaunchSpec(
            session.workspace.paths,
            session.uid,
            session.env,
            session.limits,
            session.policy.network,
            cgroup_procs,
            self.runner_file,
            session.cgroup.launcher_procs if session.cgroup else None,
            session.egress_socket,
        )

    # ---- commands --------------------------------------------------------------------------
    async def run(
        self, session: Session, command: str, timeout_s: float, fresh_state: bool = False
    ) -> RawExec:
        """Run `command` in the session (its runner, or a fresh sandbox in per_command mode). A
        failed runner is restarted (every process of the session killed, workspace kept) and the
        command reported as exit 124 (hung) or 137. `command` must be valid Unicode (the caller
        checks: UnicodeEncodeError otherwise)."""
        if self.exec_mode == "per_command":
            return await self.run_per_command(session, command, timeout_s, fresh_state)
        data = command.encode("utf-8")
        async with self.exec_slots.hold(session.session_id) as queue_s:
            start = time.perf_counter()
            if session.runner is None or not session.runner.alive:
                await self.restart_runner(session)
            try:
                raw = await session.runner.exec(
                    data, timeout_s, session.limits.max_output_bytes, fresh_state
                )
                return replace(raw, queue_ms=queue_s * 1e3)
            except RunnerFailed as exc:
                log.warning(
                    "session runner failed; restarting it",
                    extra={"session_id": session.session_id, "error": str(exc)},
                )
                await self.restart_runner(session)
                note = (
                    f"sandbox: {exc}; every process of the session was killed and the session "
                    "restarted (workspace kept)\n"
                )
                return RawExec(
                    "",
                    note,
                    124 if exc.hung else 137,
                    exc.hung,
                    0,
                    0,
                    (time.perf_counter() - start) * 1e3,
                    queue_s * 1e3,
                )

    async def run_per_command(
        self, session: Session, command: str, timeout_s: float, fresh_state: bool = False
    ) -> RawExec:
        """Run `command` in a fresh sandbox of the session (setup scripts always run this way)."""
        session.workspace.paths.command_file.write_bytes(command.encode("utf-8"))
        launch = self.isolation.command(self._spec(session), fresh_state)
        async with self.exec_slots.hold(session.session_id) as queue_s:
            raw = await run_launch(
                launch,
                timeout_s,
                session.limits.max_output_bytes,
                lambda pid: self._kill_tree(session, pid),
            )
        return replace(raw, queue_ms=queue_s * 1e3)

    # ---- the session runner ----------------------------------------------------------------
    async def start_runner(self, session: Session) -> None:
        """Start the session's runner (exec_mode=session only); RunnerFailed if it fails to."""
        if self.exec_mode != "session":
            return
        launch, prelude, fresh_prelude = self.isolation.runner(self._spec(session))
        runner = RunnerLink(launch)
        await runner.start(prelude, fresh_prelude)
        session.runner = runner
        if self.egress is not None and session.egress_socket is not None:
            try:  # the loopback door in the runner's network namespace (egress/doors.py)
                await self.egress.attach(session.session_id, runner.proc.pid)
            except Exception as exc:
                await self.stop_runner(session)
                raise RunnerFailed(f"egress listener: {exc}") from None

    async def stop_runner(self, session: Session) -> None:
        if self.egress is not None:
            await self.egress.detach(session.session_id)
        if session.runner is not None:
            runner, session.runner = session.runner, None
            await runner.stop()
        self.kill_all(session, "runner_stop")

    async def restart_runner(self, session: Session) -> None:
        await self.stop_runner(session)
        session.runner_restarts += 1
        await self.start_runner(session)

    async def ensure_runner(self, session: Session) -> None:
        """Restart the runner if the session should have one and it is gone (after kill/reset)."""
        if self.exec_mode == "session" and (session.runner is None or not session.runner.alive):
            await self.restart_runner(session)

    # ---- kills -----------------------------------------------------------------------------
    def _kill_tree(self, session: Session, pid: int) -> None:
        kill_process_group(pid)
        self.kill_all(session, "tree")

    def kill_all(self, session: Session, reason: str) -> None:
        """Every process of the session: the cgroup where there is one, else the session uid."""
        if session.cgroup is not None:
            sent = session.cgroup.kill_all()
            if sent:
                metrics.KILLS.labels(reason).inc(sent)
        elif self.is_root:
            kill_uid(session.uid)

    async def kill_processes(self, session: Session, reason: str, remove_ipc: bool = False) -> None:
        """Every process of the session but its runner dies (the runner too if it fails to
        confirm). `remove_ipc`: the runner also removes the session's SysV IPC objects (where
        the runner is gone, so is its IPC namespace; the fallback's are removed by uid)."""
        if session.runner is not None and session.runner.alive:
            try:
                await session.runner.kill_all(remove_ipc)  # keeps the runner: no sandbox restart
            except RunnerFailed:
                await self.stop_runner(session)
        if session.cgroup is not None:
            self.kill_all(session, reason)  # the runner is outside the commands' cgroup
        elif session.runner is None:
            self.kill_all(session, reason)

    def release(self, session: Session) -> None:
        """Blocking, at deletion: every process of the session killed and its cgroup removed."""
        if session.cgroup is not None:
            session.cgroup.remove()
        elif self.is_root:
            kill_uid(session.uid)
