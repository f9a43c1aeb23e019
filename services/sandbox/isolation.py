"""Isolation layers and how one command is launched in each.

Ladder, best first, chosen by a start-up probe that really runs `true` in the layer:

* `bubblewrap`: bwrap run as the session's unprivileged uid with new user (nested ones disabled),
  a seccomp denylist (seccomp.py),
  pid, net, ipc, uts and cgroup namespaces; read-only /usr and a curated /etc, a private /proc and
  a read-only private /dev, the workspace at /workspace, the session's /tmp and /dev/shm (capped:
  workspace.py), `--remount-ro /`, `--die-with-parent`, `--new-session`, all capabilities dropped,
  bwrap itself started with a minimal environment.
* `unshare`: util-linux unshare (root) with pid/net/ipc/uts/mount namespaces, a private /proc and
  the session's /dev/shm, then setpriv to the session uid with no capabilities and no_new_privs.
  The host file tree stays visible (read-only to the session uid by permissions, except the
  world-writable /tmp and /var/tmp: `host_shared_dirs`); the workspace keeps its host path.
* `fallback`: no namespaces: a new session/process group as the session uid. No network or
  file-view isolation; the host's /tmp, /var/tmp and /dev/shm are shared (see README, Security).

Whatever runs as root (setpriv, unshare, the shell that mounts /dev/shm) runs from an absolute
path with the fixed `LAUNCHER_ENV`: the task's environment (PATH, LD_PRELOAD, LD_LIBRARY_PATH ...
pointing into the workspace) is applied only after the drop to the session uid (bwrap --setenv,
or `env -i NAME=value ...` run as the session uid).

Every layer: the command joins the session cgroups first (`/bin/sh` prefix), hard rlimits are
set in bash before the command (they cannot be raised again), stdin is /dev/null, the command
text is read from a root-owned file (so 1 MB commands work), and the environment is rebuilt from
a fixed allowlist plus the task's `env`.

Two preludes: the saved-state one (agent commands: the cwd and exported variables of the last
command carry over through files the session can write) and the fresh-state one (`fresh_state`
execs, e.g. the verifier's checks): `bash --noprofile --norc`, the session's environment as at
creation minus BASH_ENV / ENV / BASH_FUNC_* (`fresh_env`), PATH = SANDBOX_PATH, cwd = the workspace
root, and no file of the session read or written.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from services.sandbox import mounts
from services.sandbox.limits import Limits
from services.sandbox.workspace import WorkspacePaths

log = logging.getLogger(__name__)

LAYERS = ("bubblewrap", "unshare", "fallback")
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LAUNCHER_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


def _tool(name: str) -> str:
    """Absolute path of a host program started as root (never found through a session's PATH)."""
    return shutil.which(name, path=LAUNCHER_ENV["PATH"]) or f"/usr/bin/{name}"


SETPRIV, BWRAP, UNSHARE, ENV_BIN = _tool("setpriv"), _tool("bwrap"), _tool("unshare"), _tool("env")
SH, IP, MOUNT = _tool("sh"), _tool("ip"), _tool("mount")
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


SECCOMP_FD = "{seccomp_fd}"  # placeholder in argv, replaced by `spawn_args`


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    seccomp_path: Path | None = None

    def spawn_args(self) -> tuple[list[str], tuple[int, ...]]:
        """argv with the seccomp program opened on a fresh fd (bwrap reads it from there), and the fds
        to pass; the caller closes the fds after spawning."""
        if self.seccomp_path is None:
            return self.argv, ()
        fd = os.open(self.seccomp_path, os.O_RDONLY | os.O_CLOEXEC)
        return [str(fd) if a == SECCOMP_FD else a for a in self.argv], (fd,)


FRESH_BASH = ["/usr/bin/bash", "--noprofile", "--norc", "-c"]
FRESH_ENV_DROPPED = ("BASH_ENV", "ENV")  # startup files a non-interactive bash would source


def base_env(workspace: str) -> dict[str, str]:
    """The fixed sanitized environment every command gets before the task's `env`."""
    return {"PATH": SANDBOX_PATH, "HOME": workspace, "LC_ALL": "C", "LANG": "C", "TERM": "dumb"}


def fresh_env(env: dict[str, str]) -> dict[str, str]:
    """The environment of a fresh-state command: the session's, without the variables that make
    bash read a file (BASH_ENV, ENV) or import functions (BASH_FUNC_*), with PATH = SANDBOX_PATH.
    runner.py drops the same variables from its own environment (it cannot import this module); the
    fresh prelude sets PATH there."""
    out = {
        k: v
        for k, v in env.items()
        if k not in FRESH_ENV_DROPPED and not k.startswith("BASH_FUNC_")
    }
    out["PATH"] = SANDBOX_PATH
    return out


def bash_prelude(
    limits: Limits,
    command_source: str,
    state_dir: str,
    cgroup_procs: tuple[str, ...] = (),
    fresh_cwd: str | None = None,
) -> str:
    """Bash run before the command, on one line (so the command's own line numbers start at 1).

    Joins the session cgroups (per-command mode; the runner joins them itself in session mode),
    sets hard rlimits (they cannot be raised again), restores the saved cwd and exported
    variables, installs an EXIT trap that saves them again, then evals the command read from
    `command_source` (a redirection such as `<&3` or `< /path`). Error messages read like
    `bash -c`: "bash: line 1: foo: command not found".

    With `fresh_cwd` (the workspace root as the command sees it) nothing under `state_dir` is
    read or written: PATH becomes SANDBOX_PATH, the cwd `fresh_cwd`, and no EXIT trap is set.
    """
    st = shlex.quote(state_dir)
    steps = [f"echo 0 > {shlex.quote(p)} || exit 125" for p in cgroup_procs]
    steps += [
        (
            f"ulimit -HS -c 0 -t {limits.cpu_s} -v {limits.address_space_bytes // 1024}"
            f" -f {limits.file_size_bytes // 1024} -n {limits.nofile} -u {limits.pids}"
            " || { echo 'sandbox: cannot set resource limits' >&2; exit 125; }"
        ),
        f"IFS= read -r -d '' __shellrl_command {command_source}",
        "exec 3<&-",
    ]
    if fresh_cwd is not None:
        steps += [
            f"export PATH={shlex.quote(SANDBOX_PATH)}",
            f"cd -- {shlex.quote(fresh_cwd)} || {{ echo 'sandbox: cannot enter the workspace' >&2; exit 125; }}",
        ]
    else:
        steps += [
            f"{{ [ -r {st}/env ] && . {st}/env; }} >/dev/null 2>&1",
            f"__shellrl_cwd=; {{ IFS= read -r -d '' __shellrl_cwd < {st}/cwd; }} 2>/dev/null",
            'cd -- "${__shellrl_cwd:-$HOME}" 2>/dev/null || cd -- "$HOME" 2>/dev/null; unset __shellrl_cwd',
            (
                f'trap \'{{ printf %s "$PWD" >| {st}/cwd && export -p >| {st}/env; }} 2>/dev/null || echo'
                ' "sandbox: the shell state (cwd, exported variables) was not saved" >&2\' EXIT'
            ),
        ]
    steps.append('eval "$__shellrl_command"')
    return "; ".join(steps)


def _setpriv(uid: int) -> list[str]:
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


class Isolation:
    """One isolation layer: how a session's programs are started in it."""

    def __init__(self, layer: str) -> None:
        if layer not in LAYERS:
            raise ValueError(f"isolation layer must be one of {LAYERS}, got {layer!r}")
        self.layer = layer
        self.seccomp_path: Path | None = None  # set once the program is written (bubblewrap only)

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
                "cgroups": tuple(
                    f"{IN_SANDBOX_RUN}/cgroup/{i}" for i in range(len(spec.cgroup_procs))
                ),
            }
        return {
            "command": str(p.command_file),
            "state": str(p.state),
            "runner": str(spec.runner_file),
            "cgroups": tuple(str(c) for c in spec.cgroup_procs),
        }

    def command(self, spec: LaunchSpec, fresh_state: bool = False) -> Launch:
        """Per-command mode: a fresh sandbox running `bash -c <prelude>` for one command
        (`bash --noprofile --norc -c <fresh prelude>` in `fresh_env` with `fresh_state`)."""
        inside = self._inside(spec)
        source = f"< {shlex.quote(inside['command'])}"
        if fresh_state:
            prelude = bash_prelude(
                spec.limits,
                source,
                inside["state"],
                inside["cgroups"],
                self.workspace_path(spec.paths),
            )
            spec = replace(spec, env=fresh_env(spec.env))
            return self._wrap(spec, [*FRESH_BASH, prelude, "bash"], as_pid1=False)
        prelude = bash_prelude(spec.limits, source, inside["state"], inside["cgroups"])
        return self._wrap(spec, ["/usr/bin/bash", "-c", prelude, "bash"], as_pid1=False)

    def runner(self, spec: LaunchSpec) -> tuple[Launch, str, str]:
        """Session mode: a long-lived runner.py (pid 1 where there is a pid namespace) and the
        two preludes it runs before each command, saved-state and fresh-state (sent in its INIT
        message, so `ps` stays readable)."""
        inside = self._inside(spec)
        prelude = bash_prelude(spec.limits, "<&3", inside["state"], inside["cgroups"])
        fresh = bash_prelude(
            spec.limits, "<&3", inside["state"], inside["cgroups"], self.workspace_path(spec.paths)
        )
        return (
            self._wrap(spec, ["/usr/bin/python3", "-I", "-S", inside["runner"]], as_pid1=True),
            prelude,
            fresh,
        )

    def _wrap(self, spec: LaunchSpec, program: list[str], as_pid1: bool) -> Launch:
        p = spec.paths
        if self.layer == "bubblewrap":
            argv = [
                *_setpriv(spec.uid),
                BWRAP,
                "--unshare-all",
                "--unshare-user",
                "--disable-userns",
            ]
            if spec.network:
                argv.append("--share-net")
            if as_pid1:
                argv.append("--as-pid-1")
            argv += [
                "--die-with-parent",
                "--new-session",
                "--cap-drop",
                "ALL",
                "--hostname",
                "sandbox",
                "--ro-bind",
                "/usr",
                "/usr",
                "--symlink",
                "usr/bin",
                "/bin",
                "--symlink",
                "usr/lib",
                "/lib",
                "--symlink",
                "usr/lib64",
                "/lib64",
                "--symlink",
                "usr/sbin",
                "/sbin",
                "--ro-bind",
                str(p.session_dir.parent / ETC_DIR),
                "/etc",
                "--proc",
                "/proc",
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
            for i, procs in enumerate(spec.cgroup_procs):
                argv += ["--bind", str(procs), f"{IN_SANDBOX_RUN}/cgroup/{i}"]
            argv += ["--remount-ro", "/", "--chdir", IN_SANDBOX_WORKSPACE, "--clearenv"]
            if self.seccomp_path is not None:
                argv += ["--seccomp", SECCOMP_FD]
            for key, value in spec.env.items():
                argv += ["--setenv", key, value]
            return Launch(argv + ["--", *program], dict(LAUNCHER_ENV), "/", self.seccomp_path)
        env = {**spec.env, "TMPDIR": str(p.tmp)}
        # the task environment only after the drop to the session uid (module doc)
        assignments = [f"{k}={v}" for k, v in env.items()]
        dropped = [*_setpriv(spec.uid), ENV_BIN, "-i", *assignments, *program]
        if self.layer == "unshare":
            net = [] if spec.network else ["--net"]
            # as root in the new namespaces: loopback up (a new network namespace starts with it
            # down; bwrap brings it up itself), the session's capped /dev/shm over the host's
            script = f'{shlex.quote(MOUNT)} --bind "$1" /dev/shm || exit 125; shift; exec "$@"'
            if net:
                script = f"{shlex.quote(IP)} link set lo up 2>/dev/null; {script}"
            argv = [
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
                *dropped,
            ]
            return Launch(argv, dict(LAUNCHER_ENV), str(p.ctl))
        return Launch(dropped, dict(LAUNCHER_ENV), str(p.ctl))


def prepare_etc(root: Path, uids: range) -> Path:
    """Build `<root>/etc`: read-only bind mounts of the allowlisted host /etc entries, plus a
    passwd/group naming every session uid "sandbox" (home /workspace). One bind per sandbox
    start instead of one per entry."""
    etc = Path(root) / ETC_DIR
    etc.mkdir(mode=0o755)
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


_PROBE_BWRAP = [
    BWRAP,
    "--unshare-all",
    "--unshare-user",
    "--disable-userns",
    "--die-with-parent",
    "--new-session",
    "--as-pid-1",
    "--cap-drop",
    "ALL",
    "--ro-bind",
    "/usr",
    "/usr",
    "--symlink",
    "usr/bin",
    "/bin",
    "--symlink",
    "usr/lib",
    "/lib",
    "--symlink",
    "usr/lib64",
    "/lib64",
    "--proc",
    "/proc",
    "--dev",
    "/dev",
    "--tmpfs",
    "/workspace",
    "--remount-ro",
    "/",
    "--clearenv",
    "--",
]
_PROBE_UNSHARE = [
    UNSHARE,
    "--pid",
    "--fork",
    "--kill-child",
    "--net",
    "--ipc",
    "--uts",
    "--mount",
    "--mount-proc",
    "--",
]
_PROBE_SCRIPT = (
    'echo ok > ${WS:-/workspace}/probe 2>/dev/null || [ -n "$WS" ]; [ ! -w /usr ] && echo ok'
)


def probe(layer: str, uid: int) -> str | None:
    """Really run a command in `layer` as `uid`; None when it works, else the reason."""
    if os.geteuid() != 0:
        return "the sandbox service needs root (uid drop to per-session uids, mounts, cgroups)"
    program = [*_setpriv(uid), "/usr/bin/bash", "-c", _PROBE_SCRIPT]
    argv = {
        "bubblewrap": [*_setpriv(uid), *_PROBE_BWRAP, "/usr/bin/bash", "-c", _PROBE_SCRIPT],
        "unshare": [*_PROBE_UNSHARE, *program],
        "fallback": program,
    }[layer]
    env = dict(LAUNCHER_ENV, WS="/nonexistent") if layer != "bubblewrap" else dict(LAUNCHER_ENV)
    try:
        out = subprocess.run(
            argv,
            env=env,
            cwd="/",
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{argv[0]}: {exc}"
    if out.returncode != 0 or b"ok" not in out.stdout:
        return f"{layer} probe exited {out.returncode}: {out.stderr.decode(errors='replace').strip()[:300]}"
    return None


def detect(choice: str, probe_uid: int) -> tuple[Isolation, dict[str, str | None]]:
    """The best working layer (or the forced one); the probe results per layer for /readyz.

    Raises RuntimeError when a forced layer does not work on this machine.
    """
    results: dict[str, str | None] = {}
    candidates = LAYERS if choice == "auto" else (choice,)
    for layer in candidates:
        results[layer] = probe(layer, probe_uid)
        if results[layer] is None:
            return Isolation(layer), results
        log.warning("isolation layer unavailable", extra={"layer": layer, "reason": results[layer]})
    raise RuntimeError(f"isolation {choice!r} is not available here: {results}")
