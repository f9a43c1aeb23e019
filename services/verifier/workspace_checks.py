"""The workspace checks: what the episode left in its sandbox session, seen only through the
`Workspace` protocol (implemented over the sandbox API in sandbox_view.py; docs/checks.md).
Each returns (passed, detail) or raises `CheckInfraError` when it cannot run.
"""

from __future__ import annotations

import asyncio
import hashlib
import shlex
from dataclasses import dataclass
from typing import Protocol

import regex

from services.verifier.answer_checks import REGEX_FLAGS, norm, short


class CheckInfraError(Exception):
    """A check could not run; the verification is FAILURE_INFRA_VERIFIER, not a reward of 0."""


class FileRefused(Exception):
    """A workspace file that the check cannot accept: missing, not a regular file, a symlink or a
    path leaving the workspace. The check fails; this is not an infrastructure error."""


class FileTooLarge(FileRefused):
    """A regular file inside the workspace, larger than the bytes the check may read."""


@dataclass(frozen=True)
class CommandOutput:
    """What a check command did. exit_code None: it did not exit (timed out, denied)."""

    stdout: str
    exit_code: int | None
    timed_out: bool
    stdout_truncated_bytes: int = 0
    policy_verdict: str = "allow"


class Workspace(Protocol):
    """The episode's workspace, as the checks see it (implemented over the sandbox API)."""

    async def run(self, command: str, timeout_s: float) -> CommandOutput:
        """Run `command` with bash in a fresh shell at the workspace root. Raises CheckInfraError."""

    async def read_file(self, path: str, max_bytes: int) -> bytes:
        """The bytes of the regular file at `path` (relative to the workspace root).

        Raises FileRefused (missing, not a regular file, leaving the workspace, larger than
        `max_bytes`) or CheckInfraError."""

    async def run_reference(self, command: str, timeout_s: float) -> CommandOutput:
        """Run `command` in a fresh copy of the post-setup workspace. Raises CheckInfraError."""


def _file_kind_script(path: str) -> str:
    """Prints one word for `path` relative to the workspace root (the shell's cwd): missing,
    outside (resolves outside the root, e.g. through a symlink), directory, file or other."""
    return (
        "root=$(pwd -P); p=$(realpath -e -- "
        + shlex.quote(path)
        + " 2>/dev/null) || { echo missing; exit 0; }; "
        'case "$p" in "$root"/*) ;; *) echo outside; exit 0;; esac; '
        'if [ -d "$p" ]; then echo directory; elif [ -f "$p" ]; then echo file; else echo other; fi'
    )


async def _file_exists(
    ws: Workspace, path: str, directory: bool, timeout_s: float
) -> tuple[bool, str]:
    if not directory:  # the sandbox's host-side open: no shell involved
        try:
            await ws.read_file(path, 0)
        except FileTooLarge:
            pass  # a non-empty regular file
        except FileRefused as exc:
            return False, f"{path}: {exc}"
        return True, f"{path}: regular file"
    out = await ws.run(_file_kind_script(path), timeout_s)
    if out.timed_out:
        return False, f"file test ran past {timeout_s:g} s"
    kind = out.stdout.strip()
    want = "directory" if directory else "file"
    return kind == want, f"{path}: {kind or 'unknown'} (want {want})"


async def _read_capped(ws: Workspace, path: str, max_file_bytes: int) -> bytes | str:
    """The file's bytes, or a reason (str) why the check fails."""
    try:
        data = await ws.read_file(path, max_file_bytes)
    except FileRefused as exc:
        return f"{path}: {exc}"
    if len(data) > max_file_bytes:  # a workspace that does not enforce max_bytes itself
        return f"{path}: larger than max_file_bytes={max_file_bytes}"
    return data


async def _file_contains(
    ws: Workspace, spec, max_file_bytes: int, timeout_s: float
) -> tuple[bool, str]:
    data = await _read_capped(ws, spec.path, max_file_bytes)
    if isinstance(data, str):
        return False, data
    if spec.WhichOneof("needle") == "substring":
        found = spec.substring.encode() in data
        return found, f"{spec.path}: substring {'found' if found else 'not found'}"
    text = data.decode("utf-8", errors="replace")
    try:
        match = await asyncio.to_thread(
            regex.search, spec.regex, text, flags=REGEX_FLAGS, timeout=timeout_s, concurrent=True
        )
    except TimeoutError:
        return False, f"{spec.path}: regex ran past {timeout_s:g} s"
    return match is not None, f"{spec.path}: regex {'matched' if match else 'did not match'}"


async def _file_sha256(ws: Workspace, spec, max_file_bytes: int) -> tuple[bool, str]:
    data = await _read_capped(ws, spec.path, max_file_bytes)
    if isinstance(data, str):
        return False, data
    digest = hashlib.sha256(data).hexdigest()
    return (
        digest == spec.sha256,
        f"{spec.path}: sha256 {digest[:16]}… {'==' if digest == spec.sha256 else '!='} {spec.sha256[:16]}…",
    )


def _command_ran(out: CommandOutput, what: str) -> None:
    if out.policy_verdict == "deny":
        raise CheckInfraError(f"the sandbox policy denied the {what}")


async def _command_output_equals(ws: Workspace, spec, timeout_s: float) -> tuple[bool, str]:
    out = await ws.run(spec.command, timeout_s)
    _command_ran(out, "check command")
    if out.timed_out:
        return False, f"command ran past {timeout_s:g} s"
    if out.stdout_truncated_bytes:
        return (
            False,
            f"command output cut by the sandbox ({out.stdout_truncated_bytes} bytes dropped)",
        )
    if spec.WhichOneof("target") == "expected":
        expected = spec.expected
    else:
        ref = await ws.run_reference(spec.reference_command, timeout_s)
        _command_ran(ref, "reference command")
        if ref.timed_out or ref.stdout_truncated_bytes:
            raise CheckInfraError("reference command timed out or its output was cut")
        expected = ref.stdout
    ok = norm(out.stdout) == norm(expected)
    return (
        ok,
        "output equal" if ok else f"output {short(norm(out.stdout))} != {short(norm(expected))}",
    )


async def _command_exit_code(ws: Workspace, spec, timeout_s: float) -> tuple[bool, str]:
    out = await ws.run(spec.command, timeout_s)
    _command_ran(out, "check command")
    if out.timed_out:
        return False, f"command ran past {timeout_s:g} s"
    return out.exit_code == spec.exit_code, f"exit code {out.exit_code} (want {spec.exit_code})"


async def run_workspace_check(
    kind: str, spec, ws: Workspace, max_file_bytes: int, timeout_s: float
) -> tuple[bool, str]:
    if kind == "file_exists":
        return await _file_exists(ws, spec.path, spec.directory, timeout_s)
    if kind == "file_contains":
        return await _file_contains(ws, spec, max_file_bytes, timeout_s)
    if kind == "file_sha256":
        return await _file_sha256(ws, spec, max_file_bytes)
    if kind == "command_output_equals":
        return await _command_output_equals(ws, spec, timeout_s)
    if kind == "command_exit_code":
        return await _command_exit_code(ws, spec, timeout_s)
    raise CheckInfraError(f"unknown check type {kind!r}")
