"""How one sandboxed program is started: its spec, its argv/env/cwd, the host programs run as root.

Whatever runs as root (setpriv, unshare, the shell that mounts /dev/shm) runs from an absolute
path with the fixed `LAUNCHER_ENV`: the task's environment (PATH, LD_PRELOAD, LD_LIBRARY_PATH ...
pointing into the workspace) is applied only after the drop to the session uid (bwrap --setenv,
or `env -i NAME=value ...` run as the session uid).

Every layer: the command joins the session cgroups first, through fds of their `cgroup.procs`
the service opens as root at each start (`Launch.spawn_args`; the files are not in the sandbox's
file tree and not writable by the session uid), hard rlimits are
set in bash before the command (they cannot be raised again), stdin is /dev/null, the command
text is read from a root-owned file (so 1 MB commands work), and the environment is rebuilt from
a fixed allowlist plus the task's `env`.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from services.sandbox.limits import Limits
from services.sandbox.workspace.files import WorkspacePaths

LAUNCHER_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


def _tool(name: str) -> str:
    """Absolute path of a host program started as root (never found through a session's PATH)."""
    return shutil.which(name, path=LAUNCHER_ENV["PATH"]) or f"/usr/bin/{name}"


SETPRIV, BWRAP, UNSHARE, ENV_BIN = _tool("setpriv"), _tool("bwrap"), _tool("unshare"), _tool("env")
SH, IP, MOUNT = _tool("sh"), _tool("ip"), _tool("mount")


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start one sandboxed program of one session."""

    paths: WorkspacePaths
    uid: int
    env: dict[str, str]
    limits: Limits
    network: bool
    cgroup_procs: tuple[Path, ...]  # host paths of the session's cgroup.procs files
    runner_file: Path | None = None  # host path of runner.py (session mode)
    launcher_procs: Path | None = None  # cgroup.procs the launcher joins as root first (v2)
    egress_socket: Path | None = None  # host path of the session's egress proxy socket, if any


SECCOMP_FD = "{seccomp_fd}"  # placeholder in argv, replaced by `spawn_args`
CGROUP_FDS = "{cgroup_fds}"  # placeholder argument: the cgroup fds, comma-separated


def cgroup_fd(i: int) -> str:
    """Placeholder (inside an argv string, e.g. a prelude) for the fd of the i-th cgroup.procs."""
    return f"{{cgroup_fd_{i}}}"


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    seccomp_path: Path | None = None
    cgroup_procs: tuple[Path, ...] = ()  # opened for writing (as root) at each spawn

    def spawn_args(self) -> tuple[list[str], tuple[int, ...]]:
        """argv with the seccomp program and the cgroup.procs files opened on fresh fds (bwrap
        reads the one, commands write their pid to the others) and their placeholders replaced;
        the fds to pass. The caller closes the fds after spawning."""
        fds: list[int] = []
        try:
            values = {}
            if self.seccomp_path is not None:
                fds.append(os.open(self.seccomp_path, os.O_RDONLY | os.O_CLOEXEC))
                values[SECCOMP_FD] = str(fds[-1])
            for i, procs in enumerate(self.cgroup_procs):
                fds.append(os.open(procs, os.O_WRONLY | os.O_CLOEXEC))
                values[cgroup_fd(i)] = str(fds[-1])
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        values[CGROUP_FDS] = ",".join(values[cgroup_fd(i)] for i in range(len(self.cgroup_procs)))
        argv = []
        for arg in self.argv:
            if arg in (SECCOMP_FD, CGROUP_FDS):
                argv.append(values[arg])
                continue
            for placeholder, value in values.items():
                arg = arg.replace(placeholder, value)
            argv.append(arg)
        return argv, tuple(fds)


def setpriv_argv(uid: int) -> list[str]:
    """Drop to `uid` by exec (keeps the service's spawn on the fast vfork path)."""
    return [
        SETPRIV,
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--no-new-privs",
        "--",
    ]
