"""Check types: what each one reads and exactly when it passes (docs/checks.md is the long form).

Consumes: one `Check` of a task, the agent's final answer (None: no answer) and a `Workspace`
(the episode's sandbox session, seen only through the sandbox API). Produces a `CheckResult`.
`run_check` dispatches to answer_checks.py (pure functions of the answer) or to
workspace_checks.py (the `Workspace` protocol and the checks that use it).

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
import time
from dataclasses import dataclass

from services.verifier.answer_checks import answer_equals, answer_integer_equals, answer_matches
from services.verifier.plugin_checks import run_plugin_check
from services.verifier.workspace_checks import CheckInfraError, Workspace, run_workspace_check
from shellrl.contract import Check

VERIFIER_VERSION = "verifier-2"
"""Version of the check semantics and the reward function; stamped on every scored trajectory.
verifier-2: check commands run with the sandbox's fresh_state (fixed PATH) after a kill of the session's processes."""


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
    if kind == "plugin":  # a plug-in's check type (plugin_checks.py)
        passed, detail = await run_plugin_check(spec, answer, workspace, timeout_s)
        return CheckResult(spec.type, passed, detail, (time.perf_counter() - start) * 1000)
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
                run_workspace_check(kind, spec, workspace, limits.max_file_bytes, timeout_s),
                timeout_s * (2 if kind == "command_output_equals" else 1) + 10,
            )
        except TimeoutError:
            raise CheckInfraError(
                f"{kind}: the sandbox did not answer within the check's budget"
            ) from None
    return CheckResult(kind, passed, detail, (time.perf_counter() - start) * 1000)


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
