"""One command's outcome in the sandbox, as `POST /v1/sessions/{id}/exec` returns it (DESIGN.md
section 2): the sandbox service builds it, the clients (rollout, verifier) read it back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shellrl.contract.errors import ContractError

Verdict = Literal["allow", "flag", "deny"]


@dataclass(frozen=True)
class PolicyVerdict:
    """The command policy's verdict and the rule that decided it (None: no rule matched)."""

    verdict: Verdict
    rule: str | None

    def as_dict(self) -> dict:
        return {"verdict": self.verdict, "rule": self.rule}


ALLOW = PolicyVerdict("allow", None)


@dataclass(frozen=True)
class ExecResult:
    """One command's outcome. `exit_code` is None when the policy denied the command; 124 with
    `timed_out` when the wall-clock limit killed it; 128+N when signal N killed it. Truncated byte
    counts: output beyond the session's cap that was dropped. `duration_ms`: wall clock (ms) the
    command ran; `queue_ms`: wall clock (ms) it waited before it started (for the session's earlier
    commands and for an exec slot shared with other sessions); 0 from senders that predate it."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    stdout_truncated_bytes: int
    stderr_truncated_bytes: int
    duration_ms: float
    policy: PolicyVerdict
    queue_ms: float = 0.0

    def as_dict(self) -> dict:
        return {
            "stdout": self.stdout,
            "stderr": self.stderr,
            "exit_code": self.exit_code,
            "timed_out": self.timed_out,
            "stdout_truncated_bytes": self.stdout_truncated_bytes,
            "stderr_truncated_bytes": self.stderr_truncated_bytes,
            "duration_ms": self.duration_ms,
            "queue_ms": self.queue_ms,
            "policy": self.policy.as_dict(),
        }

    @classmethod
    def from_json(cls, data: dict) -> ExecResult:
        """The JSON body back into an ExecResult; ContractError when a field is missing or malformed."""
        try:
            policy = data.get("policy") or {"verdict": "allow", "rule": None}
            return cls(
                stdout=data["stdout"],
                stderr=data["stderr"],
                exit_code=data["exit_code"],
                timed_out=bool(data["timed_out"]),
                stdout_truncated_bytes=int(data["stdout_truncated_bytes"]),
                stderr_truncated_bytes=int(data["stderr_truncated_bytes"]),
                duration_ms=float(data["duration_ms"]),
                policy=PolicyVerdict(policy["verdict"], policy.get("rule")),
                queue_ms=float(data.get("queue_ms", 0.0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ContractError(f"malformed exec result: {exc!r}") from None
