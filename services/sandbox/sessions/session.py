"""One session's record (what it owns: uid, workspace, cgroup, env, limits, policy, runner) and
the error a request about sessions ends with."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.sandbox.cgroups.support import SessionCgroup
from services.sandbox.execution.runner_link import RunnerLink
from services.sandbox.limits import Limits
from services.sandbox.policy import Policy
from services.sandbox.workspace.files import Workspace


class SessionError(Exception):
    """A request about sessions that cannot be served; mapped to an HTTP error by app.py
    (`details` into the error body, `retry_after_s` into a Retry-After header)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        details: dict | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.field, self.details, self.retry_after_s = field, details, retry_after_s


@dataclass
class Session:
    session_id: str
    uid: int
    workspace: Workspace
    cgroup: SessionCgroup | None
    env: dict[str, str]
    limits: Limits
    policy: Policy
    workspace_path: str
    created_at: float = field(default_factory=time.time)
    last_used_at: float = field(default_factory=time.time)
    commands: int = 0
    safety_events: list[dict] = field(default_factory=list)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False
    runner: RunnerLink | None = None
    runner_restarts: int = 0
    egress_socket: Path | None = None  # host path of its egress proxy socket (egress/doors.py)
    egress: object | None = None  # its EgressState (egress/proxy.py), if its policy has egress

    def info(self, isolation: str) -> dict:
        return {
            "session_id": self.session_id,
            "isolation": isolation,
            "workspace": self.workspace_path,
            "uid": self.uid,
            "policy": self.policy.name,
            "commands": self.commands,
            "safety_events": list(self.safety_events),
            "runner_restarts": self.runner_restarts,
            "egress": self.egress.summary() if self.egress is not None else None,
            "limits": self.limits.as_dict(),
            "created_at": self.created_at,
            "last_used_at": self.last_used_at,
        }
