"""Check types: what each one reads and exactly when it passes (docs/checks.md is the long form).

Consumes: one `Check` of a task, the agent's final answer (None: no answer) and a `Workspace`
(the episode's sandbox session, seen only through the sandbox API). Produces a `CheckResult`.

Outcomes:
* passed / failed: the check ran; the workspace or answer decided.
* `CheckInfraError`: the check could not run (sandbox unreachable, session gone, the sandbox
  policy denied the check's own command, the reference command failed). The caller turns this
  into FAILURE_INFRA_VERIFIER; it is never a reward of 0.

Every check has its own time budget: `check.timeout_s`, or `CheckLimits.default_timeout_s` when 0.
A check command (or a regex) that runs past it FAILS the check: the agent shaped the workspace the
command ran in. Changing any semantics here bumps `VERIFIER_VERSION`.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import shlex
import time
from dataclasses import dataclass
from typing import Protocol

import regex

from shellrl.contract import Check

VERIFIER_VERSION = "verifier-2"
"""Version of the check semantics and the reward function; stamped on every scored trajectory.
verifier-2: check commands run with the sandbox's fresh_state (fixed PATH) after a kill of the session's processes."""

INTEGER = re.compile(r"[+-]?[0-9]+")
REGEX_FLAGS = regex.VERSION0  # the `re`-compatible dialect of the regex module


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


@dataclass(frozen=True)
class CheckLimits:
    """default_timeout_s: budget of a check with timeout_s 0 (s). max_file_bytes: larger files fail
    file_contains / file_sha256. max_answer_chars: longer answers fail the answer checks."""

    default_timeout_s: float = 10.0
    max_file_bytes: int = 16 * 1024 * 1024
    max_answer_chars: int = 65_536


@dataclass(frozen=True)
class CheckResult:
    type: str
    passed: bool
    detail: str
    duration_ms: float = 0.0

    def to_json(self) -> dict:
        return {
            "type": self.type,
            "passed": self.passed,
            "detail": self.detail,
            "duration_ms": round(self.duration_ms, 3),
        }


def norm(text: str) -> str:
    """CRLF, then CR, become LF; then surrounding whitespace is stripped (../shared/tasks/README.md)."""
    return text.replace("\r\n", "\n").replace("\r", "\n").strip()


def _short(text: str, n: int = 80) -> str:
    return repr(text if len(text) <= n else text[:n] + "…")


# --- answer checks (pure) -----------------------------------------------------------------------


def answer_equals(answer: str, expected: str, case_insensitive: bool = False) -> tuple[bool, str]:
    """norm(answer) == norm(expected); with case_insensitive both are casefolded first."""
    a, e = norm(answer), norm(expected)
    if case_insensitive:
        a, e = a.casefold(), e.casefold()
    return (a == e), (
        "equal" if a == e else f"answer {_short(norm(answer))} != expected {_short(norm(expected))}"
    )


def answer_integer_equals(answer: str, expected: int) -> tuple[bool, str]:
    """answer.strip() is `[+-]?[0-9]+` (ASCII digits, no `_`, no spaces inside) and equals expected."""
    text = answer.strip()
    if not INTEGER.fullmatch(text):
        return False, f"answer {_short(text)} is not an integer"
    # compare digits, not int(text): Python refuses int() of more than 4300 digits (ValueError)
    negative = text.startswith("-")
    digits = text.lstrip("+-").lstrip("0") or "0"
    equal = digits == str(abs(expected)) and (digits == "0" or negative == (expected < 0))
    return equal, f"{_short(text)} {'==' if equal else '!='} {expected}"


def answer_matches(
    answer: str, pattern: str, case_insensitive: bool, timeout_s: float
) -> tuple[bool, str]:
    """norm(answer) is a FULL match of `pattern` (regex, `re` syntax). A match that runs past
    `timeout_s` fails."""
    flags = REGEX_FLAGS | (regex.IGNORECASE if case_insensitive else 0)
    try:
        found = regex.fullmatch(
            pattern, norm(answer), flags=flags, timeout=timeout_s, concurrent=True
        )
    except TimeoutError:
        return False, f"regex ran past {timeout_s:g} s"
    return (
        found is not None,
        "full match" if found else f"answer {_short(norm(answer))} does not fully match",
    )


# --- workspace checks ---------------------------------------------------------------------------


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


async def _read_capped(ws: Workspace, path: str, limits: CheckLimits) -> bytes | str:
    """The file's bytes, or a reason (str) why the check fails."""
    try:
        data = await ws.read_file(path, limits.max_file_bytes)
    except FileRefused as exc:
        return f"{path}: {exc}"
    if len(data) > limits.max_file_bytes:  # a workspace that does not enforce max_bytes itself
        return f"{path}: larger than max_file_bytes={limits.max_file_bytes}"
    return data


async def _file_contains(
    ws: Workspace, spec, limits: CheckLimits, timeout_s: float
) -> tuple[bool, str]:
    data = await _read_capped(ws, spec.path, limits)
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


async def _file_sha256(ws: Workspace, spec, limits: CheckLimits) -> tuple[bool, str]:
    data = await _read_capped(ws, spec.path, limits)
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
        "output equal" if ok else f"output {_short(norm(out.stdout))} != {_short(norm(expected))}",
    )


async def _command_exit_code(ws: Workspace, spec, timeout_s: float) -> tuple[bool, str]:
    out = await ws.run(spec.command, timeout_s)
    _command_ran(out, "check command")
    if out.timed_out:
        return False, f"command ran past {timeout_s:g} s"
    return out.exit_code == spec.exit_code, f"exit code {out.exit_code} (want {spec.exit_code})"


ANSWER_CHECKS = ("answer_equals", "answer_integer_equals", "answer_matches")


async def run_check(
    check: Check, answer: str | None, workspace: Workspace | None, limits: CheckLimits
) -> CheckResult:
    """Run one check. Raises CheckInfraError when it cannot run (including a workspace check
    without a workspace, and a sandbox call that outlives the check's budget by 10 s)."""
    kind = check.WhichOneof("kind")
    timeout_s = check.timeout_s or limits.default_timeout_s
    start = time.perf_counter()
    spec = getattr(check, kind)
    if kind in ANSWER_CHECKS:
        if answer is None:
            passed, detail = False, "no final answer"
        elif len(answer) > limits.max_answer_chars:
            passed, detail = False, f"answer longer than {limits.max_answer_chars} characters"
        elif kind == "answer_equals":
            passed, detail = answer_equals(answer, spec.expected, spec.case_insensitive)
        elif kind == "answer_integer_equals":
            passed, detail = answer_integer_equals(answer, spec.expected)
        else:
            passed, detail = await asyncio.to_thread(
                answer_matches, answer, spec.pattern, spec.case_insensitive, timeout_s
            )
    else:
        if workspace is None:
            raise CheckInfraError(f"{kind} needs the episode's sandbox session, and there is none")
        try:
            passed, detail = await asyncio.wait_for(
                _workspace_check(kind, spec, workspace, limits, timeout_s),
                timeout_s * (2 if kind == "command_output_equals" else 1) + 10,
            )
        except TimeoutError:
            raise CheckInfraError(
                f"{kind}: the sandbox did not answer within the check's budget"
            ) from None
    return CheckResult(kind, passed, detail, (time.perf_counter() - start) * 1000)


async def _workspace_check(
    kind: str, spec, ws: Workspace, limits: CheckLimits, timeout_s: float
) -> tuple[bool, str]:
    if kind == "file_exists":
        return await _file_exists(ws, spec.path, spec.directory, timeout_s)
    if kind == "file_contains":
        return await _file_contains(ws, spec, limits, timeout_s)
    if kind == "file_sha256":
        return await _file_sha256(ws, spec, limits)
    if kind == "command_output_equals":
        return await _command_output_equals(ws, spec, timeout_s)
    if kind == "command_exit_code":
        return await _command_exit_code(ws, spec, timeout_s)
    raise CheckInfraError(f"unknown check type {kind!r}")


CHECK_PARAMETERS: dict[str, dict[str, str]] = {
    "answer_equals": {"expected": "str", "case_insensitive": "bool = false"},
    "answer_integer_equals": {"expected": "int64"},
    "answer_matches": {"pattern": "str (regex, full match)", "case_insensitive": "bool = false"},
    "file_exists": {"path": "str (relative)", "directory": "bool = false"},
    "file_contains": {
        "path": "str (relative)",
        "substring": "str (one of)",
        "regex": "str (one of)",
    },
    "file_sha256": {"path": "str (relative)", "sha256": "64 lowercase hex"},
    "command_output_equals": {
        "command": "str",
        "expected": "str (one of)",
        "reference_command": "str (one of)",
    },
    "command_exit_code": {"command": "str", "exit_code": "int32 = 0"},
}
"""Parameters of each check type, for GET /v1/checks (every check also takes timeout_s: float = 0)."""
