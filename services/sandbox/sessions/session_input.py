"""What a sandbox session is given, checked before anything runs: text fields (command, setup,
env values) must be valid Unicode without NUL bytes (`check_text`), and the session environment
(`session_env`: base_env, then the task's env with <workspace> substituted) must fit the task
contract's `MAX_ENV_BYTES` and execve(2)'s caps. Every refusal is a SessionError 400 naming the
field.
"""

from __future__ import annotations

from services.sandbox.isolation.preludes import base_env
from services.sandbox.sessions.session import SessionError
from shellrl.contract.tasks import MAX_ENV_BYTES, env_bytes, first_surrogate

WORKSPACE_TOKEN = "<workspace>"
# execve(2): one `NAME=value` string at most MAX_ARG_STRLEN (32 pages); all strings together (with
# the arguments) at most ARG_MAX (a quarter of the 8 MiB stack): checked after <workspace> is
# substituted, which may lengthen values beyond what the task contract counted.
EXECVE_STRING_BYTES = 128 << 10
EXECVE_ENV_BYTES = 1 << 20


def check_text(value: str, field: str, code: str) -> None:
    """SessionError 400 `code` naming `field` when `value` has a NUL byte or a lone UTF-16
    surrogate (JSON can carry `"\\ud800"`; no program can be given it)."""
    if "\x00" in value:
        raise SessionError(400, code, f"{field} contains a NUL byte (\\x00); remove it", field)
    if (at := first_surrogate(value)) is not None:
        raise SessionError(
            400,
            code,
            f"{field} contains a lone UTF-16 surrogate "
            f"({ascii(value[at])} at character {at}): not valid Unicode; "
            "send UTF-8 text",
            field,
        )


def session_env(env: dict[str, str], workspace_path: str) -> dict[str, str]:
    """The session environment: base_env, then `env` with <workspace> substituted.
    SessionError 400 invalid_env (bad name or value) / env_too_large."""
    out = base_env(workspace_path)
    for key, value in env.items():
        if (
            not key
            or not (key[0].isalpha() or key[0] == "_")
            or not all(c.isalnum() or c == "_" for c in key)
        ):
            shown = key[:200].encode("utf-8", "backslashreplace").decode()
            raise SessionError(
                400,
                "invalid_env",
                f"env name {key[:200]!r} is not a shell variable name",
                f"env.{shown}",
            )
        check_text(value, f"env.{key}", "invalid_env")
    if (size := env_bytes(env)) > MAX_ENV_BYTES:
        raise SessionError(
            400,
            "env_too_large",
            f"env has {size} bytes (NAME=value plus a NUL each); at most "
            f"{MAX_ENV_BYTES}: every program inherits it (execve caps)",
            "env",
        )
    for key, value in env.items():
        out[key] = value.replace(WORKSPACE_TOKEN, workspace_path)
        if len(key.encode()) + len(out[key].encode()) + 2 > EXECVE_STRING_BYTES:
            raise SessionError(
                400,
                "env_too_large",
                f"env.{key} with {WORKSPACE_TOKEN} substituted is longer than "
                f"{EXECVE_STRING_BYTES} bytes (execve's cap)",
                f"env.{key}",
            )
    if env_bytes(out) > EXECVE_ENV_BYTES:
        raise SessionError(
            400,
            "env_too_large",
            f"env with {WORKSPACE_TOKEN} substituted is larger than {EXECVE_ENV_BYTES} bytes",
            "env",
        )
    return out
