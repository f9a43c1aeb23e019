"""Isolation layers and how one command is launched in each.

Ladder, best first, chosen by a start-up probe that really runs `true` in the layer:

* `bubblewrap`: bwrap run as the session's unprivileged uid with new user (nested ones disabled),
  pid, net, ipc, uts and cgroup namespaces; read-only /usr and a curated /etc, a private /proc and
  /dev, the workspace at /workspace, the session's /tmp, `--remount-ro /`, `--die-with-parent`,
  `--new-session`, all capabilities dropped, bwrap itself started with a minimal environment.
* `unshare`: util-linux unshare (root) with pid/net/ipc/uts/mount namespaces and a private /proc,
  then setpriv to the session uid with no capabilities and no_new_privs. The host file tree stays
  visible (read-only to the session uid by permissions); the workspace keeps its host path.
* `fallback`: no namespaces: a new session/process group as the session uid. No network or
  file-view isolation (see README, Security).

Every layer: the command joins the session cgroups first (`/bin/sh` prefix), hard rlimits are
set in bash before the command (they cannot be raised again), stdin is /dev/null, the command
text is read from a root-owned file (so 1 MB commands work), and the environment is rebuilt from
a fixed allowlist plus the task's `env`.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

from services.sandbox.limits import Limits
from services.sandbox.workspace import WorkspacePaths

log = logging.getLogger(__name__)

LAYERS = ("bubblewrap", "unshare", "fallback")
SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LAUNCHER_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
IN_SANDBOX_WORKSPACE = "/workspace"
IN_SANDBOX_RUN = "/run/shellrl"
# /etc entries the bubblewrap sandbox sees (read-only); passwd and group are per-session files.
ETC_ALLOWLIST = (
    "alternatives", "bash.bashrc", "ca-certificates", "ca-certificates.conf", "debian_version", "host.conf",
    "hostname", "hosts", "inputrc", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "locale.alias", "localtime",
    "magic", "magic.mime", "mime.types", "nsswitch.conf", "os-release", "profile", "protocols", "python3",
    "python3.11", "resolv.conf", "services", "ssl", "timezone",
)


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to launch one command of one session."""

    paths: WorkspacePaths
    uid: int
    env: dict[str, str]
    limits: Limits
    network: bool
    cgroup_procs: tuple[Path, ...]


@dataclass(frozen=True)
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    as_uid: int | None  # uid the launcher process runs as (None = the service's own)


def base_env(workspace: str) -> dict[str, str]:
    """The fixed sanitized environment every command gets before the task's `env`."""
    return {"PATH": SANDBOX_PATH, "HOME": workspace, "LC_ALL": "C", "LANG": "C", "TERM": "dumb"}


def bash_prelude(limits: Limits, command_file: str, state_dir: str) -> str:
    """Bash run before the command: hard rlimits, the saved cwd and exported variables, and an
    EXIT trap that saves them again. The command itself is read from `command_file` and eval'd,
    so error messages read like `bash -c` ("bash: foo: command not found")."""
    st = shlex.quote(state_dir)
    steps = (
        f"ulimit -HS -c 0 -t {limits.cpu_s} -v {limits.address_space_bytes // 1024}"
        f" -f {limits.file_size_bytes // 1024} -n {limits.nofile} -u {limits.pids}"
        " || { echo 'sandbox: cannot set resource limits' >&2; exit 125; }",
        f"IFS= read -r -d '' __shellrl_command < {shlex.quote(command_file)}",
        f"{{ [ -r {st}/env ] && . {st}/env; }} >/dev/null 2>&1",
        f"__shellrl_cwd=; {{ IFS= read -r -d '' __shellrl_cwd < {st}/cwd; }} 2>/dev/null",
        'cd -- "${__shellrl_cwd:-$HOME}" 2>/dev/null || cd -- "$HOME" 2>/dev/null; unset __shellrl_cwd',
        f"trap '{{ printf %s \"$PWD\" > {st}/cwd; export -p > {st}/env; }} 2>/dev/null' EXIT",
        'eval "$__shellrl_command"',
    )
    return "; ".join(steps)  # one line, so the command's line numbers start at 1


def _cgroup_prefix(procs: tuple[Path, ...]) -> list[str]:
    if not procs:
        return []
    joins = " && ".join(f"echo $$ > {shlex.quote(str(p))}" for p in procs)
    script = f"{joins} || {{ echo 'sandbox: cannot join the session cgroup' >&2; exit 125; }}; exec \"$@\""
    return ["/bin/sh", "-c", script, "sh"]


class Isolation:
    """One isolation layer; `launch(spec)` gives the argv/env/cwd/uid for a command."""

    def __init__(self, layer: str) -> None:
        if layer not in LAYERS:
            raise ValueError(f"isolation layer must be one of {LAYERS}, got {layer!r}")
        self.layer = layer

    @property
    def network_isolated(self) -> bool:
        return self.layer != "fallback"

    def workspace_path(self, paths: WorkspacePaths) -> str:
        """The workspace path as commands see it."""
        return IN_SANDBOX_WORKSPACE if self.layer == "bubblewrap" else str(paths.ws)

    def launch(self, spec: LaunchSpec) -> Launch:
        if self.layer == "bubblewrap":
            return self._bubblewrap(spec)
        if self.layer == "unshare":
            return self._unshare(spec)
        return self._fallback(spec)

    def _bubblewrap(self, spec: LaunchSpec) -> Launch:
        p = spec.paths
        argv = ["bwrap", "--unshare-all", "--unshare-user", "--disable-userns"]
        if spec.network:
            argv.append("--share-net")
        argv += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "sandbox",
                 "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
                 "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin", "/sbin"]
        for name in ETC_ALLOWLIST:
            argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        argv += ["--ro-bind", str(p.ctl / "passwd"), "/etc/passwd", "--ro-bind", str(p.ctl / "group"), "/etc/group",
                 "--proc", "/proc", "--dev", "/dev",
                 "--bind", str(p.ws), IN_SANDBOX_WORKSPACE, "--bind", str(p.tmp), "/tmp",
                 "--bind", str(p.state), f"{IN_SANDBOX_RUN}/state",
                 "--ro-bind", str(p.command_file), f"{IN_SANDBOX_RUN}/command",
                 "--remount-ro", "/", "--chdir", IN_SANDBOX_WORKSPACE, "--clearenv"]
        for key, value in spec.env.items():
            argv += ["--setenv", key, value]
        prelude = bash_prelude(spec.limits, f"{IN_SANDBOX_RUN}/command", f"{IN_SANDBOX_RUN}/state")
        argv += ["--", "/usr/bin/bash", "-c", prelude, "bash"]
        return Launch(_cgroup_prefix(spec.cgroup_procs) + argv, dict(LAUNCHER_ENV), "/", spec.uid)

    def _unshare(self, spec: LaunchSpec) -> Launch:
        p = spec.paths
        net = [] if spec.network else ["--net"]
        argv = ["unshare", "--pid", "--fork", "--kill-child", *net, "--ipc", "--uts", "--mount", "--mount-proc",
                "--", "setpriv", f"--reuid={spec.uid}", f"--regid={spec.uid}", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs",
                "--", "/usr/bin/bash", "-c", bash_prelude(spec.limits, str(p.command_file), str(p.state)), "bash"]
        env = {**spec.env, "TMPDIR": str(p.tmp)}
        return Launch(_cgroup_prefix(spec.cgroup_procs) + argv, env, str(p.ws), None)

    def _fallback(self, spec: LaunchSpec) -> Launch:
        p = spec.paths
        argv = ["/usr/bin/bash", "-c", bash_prelude(spec.limits, str(p.command_file), str(p.state)), "bash"]
        env = {**spec.env, "TMPDIR": str(p.tmp)}
        return Launch(_cgroup_prefix(spec.cgroup_procs) + argv, env, str(p.ws), spec.uid)


def _probe_command(layer: str, uid: int) -> tuple[list[str], int | None]:
    if layer == "bubblewrap":
        return (["bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                 "--new-session", "--cap-drop", "ALL", "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin",
                 "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64", "--proc", "/proc",
                 "--dev", "/dev", "--tmpfs", "/workspace", "--remount-ro", "/", "--clearenv",
                 "--", "/usr/bin/bash", "-c", "echo ok > /workspace/probe && [ ! -w /usr ] && echo ok"], uid)
    if layer == "unshare":
        return (["unshare", "--pid", "--fork", "--kill-child", "--net", "--ipc", "--uts", "--mount",
                 "--mount-proc", "--", "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                 "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--", "/usr/bin/bash", "-c", "echo ok"],
                None)
    return ["/usr/bin/bash", "-c", "echo ok"], uid


def probe(layer: str, uid: int) -> str | None:
    """Run `true`-like work in `layer` as `uid`; None when it works, else the reason."""
    if layer == "unshare" and os.geteuid() != 0:
        return "the unshare layer needs root (it drops to the session uid with setpriv)"
    argv, as_uid = _probe_command(layer, uid)
    kwargs = {}
    if as_uid is not None and os.geteuid() == 0:
        kwargs = {"user": as_uid, "group": as_uid, "extra_groups": []}
    try:
        out = subprocess.run(argv, env=dict(LAUNCHER_ENV), cwd="/", stdin=subprocess.DEVNULL,
                             capture_output=True, timeout=10, **kwargs)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{argv[0]}: {exc}"
    if out.returncode != 0 or b"ok" not in out.stdout:
        return f"{argv[0]} exited {out.returncode}: {out.stderr.decode(errors='replace').strip()[:300]}"
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
