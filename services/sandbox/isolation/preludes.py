"""The bash run before each sandboxed command, and the environments commands start with.

Two preludes: the saved-state one (agent commands: the cwd and exported variables of the last
command carry over through files the session can write) and the fresh-state one (`fresh_state`
execs, e.g. the verifier's checks): `bash --noprofile --norc`, the session's environment as at
creation minus BASH_ENV / ENV / BASH_FUNC_* (`fresh_env`), PATH = SANDBOX_PATH, cwd = the workspace
root, and no file of the session read or written.
"""

from __future__ import annotations

import shlex

from services.sandbox.isolation import argv_trace
from services.sandbox.limits import Limits

SANDBOX_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FRESH_BASH = ["/usr/bin/bash", "--noprofile", "--norc", "-c"]
FRESH_ENV_DROPPED = ("BASH_ENV", "ENV")  # startup files a non-interactive bash would source
RUNNER_CGROUP_FD_FIRST = (
    4  # where runner.py puts the cgroup.procs fds of a command (its CGROUP_FD_FIRST)
)


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
    cgroup_fds: tuple[str, ...] = (),
    fresh_cwd: str | None = None,
) -> str:
    """Bash run before the command, on one line (so the command's own line numbers start at 1).

    Joins the session cgroups by writing its pid to `cgroup_fds` (fds of their `cgroup.procs`,
    opened by the service: launch.py; no cgroup file is in the session's reach) and closes them,
    sets hard rlimits (they cannot be raised again), restores the saved cwd and exported
    variables, installs an EXIT trap that saves them again, then evals the command read from
    `command_source` (a redirection such as `<&3` or `< /path`). Error messages read like
    `bash -c`: "bash: line 1: foo: command not found".

    With `fresh_cwd` (the workspace root as the command sees it) nothing under `state_dir` is
    read or written: PATH becomes SANDBOX_PATH, the cwd `fresh_cwd`, and no EXIT trap is set.
    """
    st = shlex.quote(state_dir)
    steps = [f"echo 0 >&{fd} || exit 125" for fd in cgroup_fds]
    if cgroup_fds:
        steps.append("exec " + " ".join(f"{fd}>&-" for fd in cgroup_fds))
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
            # the executed-argv trace (argv_trace.py): on before the saved state is read, so no
            # function that state defines can stand in for `exec` or `set` here
            *argv_trace.start_steps(st),
            f"{{ [ -r {st}/env ] && . {st}/env; }} >/dev/null 2>&1",
            f"__shellrl_cwd=; {{ IFS= read -r -d '' __shellrl_cwd < {st}/cwd; }} 2>/dev/null",
            'cd -- "${__shellrl_cwd:-$HOME}" 2>/dev/null || cd -- "$HOME" 2>/dev/null; unset __shellrl_cwd',
            (
                f"trap '{argv_trace.TRAP_PREFIX}"
                f'{{ printf %s "$PWD" >| {st}/cwd && export -p >| {st}/env; }} 2>/dev/null || '
                f'{{ {argv_trace.overflow_step(st)} && printf %s "$PWD" >| {st}/cwd && '
                f"export -p >| {st}/env; }} 2>/dev/null || echo"
                ' "sandbox: the shell state (cwd, exported variables) was not saved" >&2\' EXIT'
            ),
            argv_trace.START_MARKER,  # what the trace shows from here on is the command's
        ]
    steps.append('eval "$__shellrl_command"')
    return "; ".join(steps)
