"""Isolation layers and how one command is launched in each.

Ladder, best first, chosen by a start-up probe that really runs `true` in the layer:

* `bubblewrap`: bwrap run as the session's unprivileged uid with new user (nested ones disabled),
  a seccomp denylist (seccomp.py), pid, net, ipc, uts and cgroup namespaces; read-only /usr and a
  curated /etc, a private /proc (host details masked: proc_view.py) and a read-only private /dev,
  the workspace at /workspace, the session's /tmp and /dev/shm (capped: workspace/files.py),
  `--remount-ro /`, `--die-with-parent`, `--new-session`, all capabilities dropped, bwrap itself
  started with a minimal environment.
* `unshare`: util-linux unshare (root) with pid/net/ipc/uts/mount namespaces, a private /proc
  (host details masked: proc_view.py) and the session's /dev/shm, then setpriv to the session uid
  with no capabilities and no_new_privs.
  The host file tree stays visible (read-only to the session uid by permissions, except the
  world-writable /tmp and /var/tmp: `host_shared_dirs`); the workspace keeps its host path.
* `fallback`: no namespaces: a new session/process group as the session uid. No network or
  file-view isolation; the host's /tmp, /var/tmp and /dev/shm are shared (see README, Security).

Where cgroup v2 needs it (`LaunchSpec.launcher_procs`), the launcher first moves itself, as root,
into the session's cgroup, so the whole sandbox starts inside it. Commands join the session's
cgroups through fds of their `cgroup.procs` that the service opens as root at each start
(launch.py); no layer binds a cgroup file into the sandbox.

The launch itself (`LaunchSpec`, `Launch`, the host programs run as root) is launch.py; the bash
preludes and environments are preludes.py; probing which layer works is probe.py.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import replace
from pathlib import Path

from services.sandbox.host import mounts
from services.sandbox.isolation import proc_view
from services.sandbox.isolation.launch import (
    BWRAP,
    CGROUP_FDS,
    ENV_BIN,
    IP,
    LAUNCHER_ENV,
    MOUNT,
    SECCOMP_FD,
    SH,
    UNSHARE,
    Launch,
    LaunchSpec,
    cgroup_fd,
    setpriv_argv,
)
from services.sandbox.isolation.preludes import (
    FRESH_BASH,
    RUNNER_CGROUP_FD_FIRST,
    bash_prelude,
    fresh_env,
)
from services.sandbox.workspace.files import WorkspacePaths

LAYERS = ("bubblewrap", "unshare", "fallback")
IN_SANDBOX_WORKSPACE = "/workspace"
IN_SANDBOX_RUN = "/run/shellrl"
ETC_DIR = "etc"  # <workspace root>/etc: the curated /etc of bubblewrap sandboxes (see prepare_etc)
# /etc entries the bubblewrap sandbox sees (read-only, live bind mounts); passwd/group are generated.
ETC_ALLOWLIST = (
    "alternatives",
    "bash.bashrc",
    "ca-certificates",
    "ca-certificates.conf",
    "debian_version",
    "host.conf",
    "hostname",
    "hosts",
    "inputrc",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "locale.alias",
    "localtime",
    "magic",
    "magic.mime",
    "mime.types",
    "nsswitch.conf",
    "os-release",
    "profile",
    "protocols",
    "python3",
    "python3.11",
    "resolv.conf",
    "services",
    "ssl",
    "timezone",
)


BWRAP_NAMESPACES = ("--unshare-all", "--unshare-user", "--disable-userns")
"""bwrap's namespaces: all of them new, a user namespace the sandbox cannot nest."""
BWRAP_PROCESS = ("--die-with-parent", "--new-session", "--cap-drop", "ALL")
"""bwrap's process rules: dies with its launcher, no controlling terminal, no capabilities."""
BWRAP_USR = (
    "--ro-bind", "/usr", "/usr",
    "--symlink", "usr/bin", "/bin",
    "--symlink", "usr/lib", "/lib",
    "--symlink", "usr/lib64", "/lib64",
)  # fmt: skip
"""The host's /usr read-only and the merged-/usr links: the programs a sandbox runs."""


class Isolation:
    """One isolation layer: how a session's programs are started in it."""

    def __init__(self, layer: str) -> None:
        if layer not in LAYERS:
            raise ValueError(f"isolation layer must be one of {LAYERS}, got {layer!r}")
        self.layer = layer
        self.seccomp_path: Path | None = None  # set once the program is written (bubblewrap only)
        self.runtime: Path | None = None  # set by `install_proc_files`
        self.proc_masks = proc_view.masks()

    def install_proc_files(self, runtime: Path) -> None:
        """Write the /proc files all sessions share (proc_view.install) into `runtime`."""
        proc_view.install(runtime)
        self.runtime = runtime

    def prepare_session(self, paths: WorkspacePaths, memory_bytes: int) -> None:
        """Write the session's own /proc files into its ctl/ (bubblewrap, unshare): a meminfo
        sized to `memory_bytes`, and for unshare the fstab that mounts them and the masks."""
        if self.layer == "fallback":
            return
        meminfo = paths.ctl / "meminfo"
        meminfo.write_text(proc_view.session_meminfo(memory_bytes))
        os.chmod(meminfo, 0o644)
        if self.layer == "unshare":
            table = proc_view.fstab(meminfo, self.runtime, *self.proc_masks)
            (paths.ctl / "fstab").write_text(table)

    @property
    def network_isolated(self) -> bool:
        return self.layer != "fallback"

    @property
    def host_shared_dirs(self) -> tuple[str, ...]:
        """World-writable host directories a session can write in this layer (outside every
        cap); what a session leaves there is removed at snapshot, reset and deletion."""
        return {
            "bubblewrap": (),
            "unshare": ("/tmp", "/var/tmp"),
            "fallback": ("/tmp", "/var/tmp", "/dev/shm"),
        }[self.layer]

    def workspace_path(self, paths: WorkspacePaths) -> str:
        """The workspace path as commands see it."""
        return IN_SANDBOX_WORKSPACE if self.layer == "bubblewrap" else str(paths.ws)

    def _inside(self, spec: LaunchSpec) -> dict[str, str | tuple[str, ...]]:
        """Paths of the session's files as the sandboxed program sees them."""
        p = spec.paths
        if self.layer == "bubblewrap":
            return {
                "command": f"{IN_SANDBOX_RUN}/command",
                "state": f"{IN_SANDBOX_RUN}/state",
                "runner": f"{IN_SANDBOX_RUN}/runner.py",
            }
        return {
            "command": str(p.command_file),
            "state": str(p.state),
            "runner": str(spec.runner_file),
        }

    def command(self, spec: LaunchSpec, fresh_state: bool = False) -> Launch:
        """Per-command mode: a fresh sandbox running `bash -c <prelude>` for one command
        (`bash --noprofile --norc -c <fresh prelude>` in `fresh_env` with `fresh_state`)."""
        inside = self._inside(spec)
        source = f"< {shlex.quote(inside['command'])}"
        cgroups = tuple(cgroup_fd(i) for i in range(len(spec.cgroup_procs)))
        if fresh_state:
            prelude = bash_prelude(
                spec.limits, source, inside["state"], cgroups, self.workspace_path(spec.paths)
            )
            spec = replace(spec, env=fresh_env(spec.env))
            return self._wrap(spec, [*FRESH_BASH, prelude, "bash"], as_pid1=False)
        prelude = bash_prelude(spec.limits, source, inside["state"], cgroups)
        return self._wrap(spec, ["/usr/bin/bash", "-c", prelude, "bash"], as_pid1=False)

    def runner(self, spec: LaunchSpec) -> tuple[Launch, str, str]:
        """Session mode: a long-lived runner.py (pid 1 where there is a pid namespace) and the
        two preludes it runs before each command, saved-state and fresh-state (sent in its INIT
        message, so `ps` stays readable)."""
        inside = self._inside(spec)
        n = len(spec.cgroup_procs)
        cgroups = tuple(str(RUNNER_CGROUP_FD_FIRST + i) for i in range(n))
        prelude = bash_prelude(spec.limits, "<&3", inside["state"], cgroups)
        fresh = bash_prelude(
            spec.limits, "<&3", inside["state"], cgroups, self.workspace_path(spec.paths)
        )
        program = ["/usr/bin/python3", "-I", "-S", inside["runner"], *([CGROUP_FDS] if n else [])]
        return self._wrap(spec, program, as_pid1=True), prelude, fresh

    def _wrap(self, spec: LaunchSpec, program: list[str], as_pid1: bool) -> Launch:
        """`program` started in this instance's layer (module doc), joined to the session's
        cgroup where there is one."""
        if self.layer == "bubblewrap":
            return self._wrap_bubblewrap(spec, program, as_pid1)
        p = spec.paths
        env = {**spec.env, "TMPDIR": str(p.tmp)}
        # the task environment only after the drop to the session uid (module doc)
        assignments = [f"{k}={v}" for k, v in env.items()]
        dropped = [*setpriv_argv(spec.uid), ENV_BIN, "-i", *assignments, *program]
        if self.layer == "unshare":
            argv = _join_cgroup(spec) + _unshare_argv(spec, dropped)
            return Launch(argv, dict(LAUNCHER_ENV), str(p.ctl), None, spec.cgroup_procs)
        argv = _join_cgroup(spec) + dropped
        return Launch(argv, dict(LAUNCHER_ENV), str(p.ctl), None, spec.cgroup_procs)

    def _wrap_bubblewrap(self, spec: LaunchSpec, program: list[str], as_pid1: bool) -> Launch:
        """bwrap as the session's uid (module doc: what it unshares, binds and drops)."""
        p = spec.paths
        argv = [*setpriv_argv(spec.uid), BWRAP, *BWRAP_NAMESPACES]
        if spec.network:
            argv.append("--share-net")
        if as_pid1:
            argv.append("--as-pid-1")
        argv += [
            *BWRAP_PROCESS,
            "--hostname",
            "sandbox",
            *BWRAP_USR,
            "--symlink",
            "usr/sbin",
            "/sbin",
            "--ro-bind",
            str(p.session_dir.parent / ETC_DIR),
            "/etc",
            "--proc",
            "/proc",
            *proc_view.bwrap_args(p.ctl / "meminfo", self.runtime, *self.proc_masks),
            "--dev",
            "/dev",
            "--bind",
            str(p.shm),
            "/dev/shm",
            "--remount-ro",
            "/dev",
            "--bind",
            str(p.ws),
            IN_SANDBOX_WORKSPACE,
            "--bind",
            str(p.tmp),
            "/tmp",
            "--bind",
            str(p.state),
            f"{IN_SANDBOX_RUN}/state",
            "--ro-bind",
            str(p.command_file),
            f"{IN_SANDBOX_RUN}/command",
        ]
        if spec.runner_file is not None:
            argv += ["--ro-bind", str(spec.runner_file), f"{IN_SANDBOX_RUN}/runner.py"]
        if spec.egress_socket is not None:  # the egress proxy's door (egress/doors.py)
            argv += ["--ro-bind", str(spec.egress_socket), f"{IN_SANDBOX_RUN}/egress.sock"]
        argv += ["--remount-ro", "/", "--chdir", IN_SANDBOX_WORKSPACE, "--clearenv"]
        if self.seccomp_path is not None:
            argv += ["--seccomp", SECCOMP_FD]
        for key, value in spec.env.items():
            argv += ["--setenv", key, value]
        argv = _join_cgroup(spec) + argv
        return Launch(
            argv + ["--", *program],
            dict(LAUNCHER_ENV),
            "/",
            self.seccomp_path,
            spec.cgroup_procs,
        )


def _unshare_argv(spec: LaunchSpec, dropped: list[str]) -> list[str]:
    """util-linux unshare (root) in new namespaces, then `dropped` (the drop to the session uid
    and the program)."""
    p = spec.paths
    net = [] if spec.network else ["--net"]
    # as root in the new namespaces: loopback up (a new network namespace starts with it
    # down; bwrap brings it up itself), the session's capped /dev/shm over the host's, the
    # /proc masks and the session's meminfo/loadavg (one `mount -a`: proc_view.fstab)
    script = (
        f'{shlex.quote(MOUNT)} --bind "$1" /dev/shm || exit 125; '
        f'{shlex.quote(MOUNT)} -a --fstab "$2" || exit 125; shift 2; exec "$@"'
    )
    if net:
        script = f"{shlex.quote(IP)} link set lo up 2>/dev/null; {script}"
    return [
        UNSHARE,
        "--pid",
        "--fork",
        "--kill-child",
        *net,
        "--ipc",
        "--uts",
        "--mount",
        "--mount-proc",
        "--",
        SH,
        "-c",
        script,
        "sh",
        str(p.shm),
        str(p.ctl / "fstab"),
        *dropped,
    ]


def _join_cgroup(spec: LaunchSpec) -> list[str]:
    """argv prefix (run as root) moving the launcher into `spec.launcher_procs`, if any."""
    if spec.launcher_procs is None:
        return []
    script = 'echo $$ > "$1" || exit 125; shift; exec "$@"'
    return [SH, "-c", script, "sh", str(spec.launcher_procs)]


def prepare_etc(root: Path, uids: range) -> Path:
    """Build `<root>/etc` (a tmpfs): read-only bind mounts of the allowlisted host /etc entries,
    plus a passwd/group naming every session uid "sandbox" (home /workspace). One bind per sandbox
    start instead of one per entry."""
    etc = Path(root) / ETC_DIR
    etc.mkdir(mode=0o755)
    # its own small tmpfs: bound at /etc, it names no host path in the sandbox's mountinfo
    mounts.mount("tmpfs", etc, "tmpfs", mounts.MS_NOSUID | mounts.MS_NODEV, "size=16m,mode=0755")
    for name in ETC_ALLOWLIST:
        source = Path("/etc") / name
        if not source.exists():
            continue
        target = etc / name
        if source.is_dir():
            target.mkdir()
        else:
            target.touch()
        mounts.mount(str(source), target, None, mounts.MS_BIND | mounts.MS_REC)
        mounts.mount(None, target, None, mounts.MS_REMOUNT | mounts.MS_BIND | mounts.MS_RDONLY)
    users = [
        "root:x:0:0:root:/root:/usr/sbin/nologin",
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin",
    ]
    groups = ["root:x:0:", "nogroup:x:65534:"]
    users += [f"sandbox:x:{u}:{u}:sandbox:{IN_SANDBOX_WORKSPACE}:/bin/bash" for u in uids]
    groups += [f"sandbox:x:{u}:" for u in uids]
    (etc / "passwd").write_text("\n".join(users) + "\n")
    (etc / "group").write_text("\n".join(groups) + "\n")
    return etc
