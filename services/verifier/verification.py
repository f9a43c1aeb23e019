"""One verification: run a task's checks against an episode's workspace, then compute its reward.

The single code path of the verifier: the stream worker (worker.py) and `POST /v1/verify`
(app.py) both call `Verifier.verify`. Guarantees:
* every check runs (in task order) unless one cannot run; then the whole verification is
  FAILURE_INFRA_VERIFIER with no reward (never 0), and the detail says which check and why;
* any unexpected error inside one verification is caught and becomes that verification's
  INFRA failure: it never touches another episode, of the same group or not;
* the agent's own claims are never read: only the answer string, the tool events the
  harness recorded, and what the sandbox reports about the workspace.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.verifier import metrics
from services.verifier.checks import VERIFIER_VERSION, CheckLimits, CheckResult, run_check
from services.verifier.reward_components import TerminalRewards
from services.verifier.rewards import (
    SAFETY_VERDICTS,
    Reward,
    Shaping,
    compute_reward,
    safety_flagged,
)
from services.verifier.sandbox_view import ReferenceCache, SandboxWorkspace
from services.verifier.workspace_checks import CheckInfraError
from shellrl.contract import Failure, Task, ToolEvent, Trajectory, failure_label, split_name
from shellrl.contract.trajectory import set_check_results

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verification:
    """Result of one verification. reward is None exactly when failure != FAILURE_NONE."""

    checks: tuple[CheckResult, ...]
    reward: Reward | None
    failure: int = Failure.FAILURE_NONE
    failure_detail: str = ""
    duration_ms: float = 0.0
    safety_events: tuple[str, ...] = field(default=())

    @property
    def scored(self) -> bool:
        return self.reward is not None

    def to_json(self) -> dict:
        """The body of POST /v1/verify (reward and training_reward are null when unscored)."""
        return {
            "reward": self.reward.reward if self.reward else None,
            "training_reward": self.reward.training_reward if self.reward else None,
            "reward_components": dict(self.reward.components) if self.reward else {},
            "checks": [c.to_json() for c in self.checks],
            "failure": None if self.scored else failure_label(self.failure),
            "failure_detail": self.failure_detail or None,
            "safety_events": list(self.safety_events),
            "verifier_version": VERIFIER_VERSION,
            "duration_ms": round(self.duration_ms, 3),
        }

    def apply_to(self, traj: Trajectory) -> None:
        """Write the outcome into `traj`: reward (NaN when unscored), training_reward,
        reward_components, the per-check results (`checks`, detail cut to 1,000 characters),
        scored, failure, verifier_version, scored_at."""
        traj.verifier_version = VERIFIER_VERSION
        traj.scored_at = time.time()
        traj.scored = self.scored
        traj.reward_components.clear()
        set_check_results(traj, [c.to_json() for c in self.checks])
        if self.reward is None:
            traj.reward = traj.training_reward = math.nan
            traj.failure = self.failure
            traj.failure_detail = self.failure_detail
            return
        traj.reward = self.reward.reward
        traj.training_reward = self.reward.training_reward
        traj.reward_components.update(self.reward.components)
        for rule in self.safety_events:
            if rule not in traj.safety_events:
                traj.safety_events.append(rule)


class Verifier:
    """Checks plus reward over the sandbox service.

    sandbox: a shellrl.clients.sandbox.SandboxClient (None: only answer checks can run).
    terminal: the reward components of a real terminal (reward_components.py; None: all off).
    """

    def __init__(
        self,
        sandbox,
        limits: CheckLimits,
        shaping: Shaping,
        reference_cache: ReferenceCache,
        terminal: TerminalRewards | None = None,
    ) -> None:
        self.sandbox, self.limits, self.shaping, self.reference_cache = (
            sandbox,
            limits,
            shaping,
            reference_cache,
        )
        self.terminal = terminal

    async def verify(
        self,
        task: Task,
        answer: str | None,
        session_id: str | None,
        tool_events: Sequence[ToolEvent] = (),
        trajectory_id: str = "",
    ) -> Verification:
        """Verify one episode of `task`. Never raises: failures come back as data.
        `trajectory_id` keys the safety component's per-episode record (a re-delivery is not
        counted twice); '' = not recorded."""
        start = time.perf_counter()
        try:
            result = await self._verify(task, answer, session_id, tool_events, trajectory_id)
        except CheckInfraError as exc:
            result = Verification((), None, Failure.FAILURE_INFRA_VERIFIER, str(exc))
        except Exception as exc:  # a bug or an unforeseen sandbox answer: this episode only
            log.exception("verification crashed", extra={"task_id": task.task_id})
            result = Verification(
                (), None, Failure.FAILURE_INFRA_VERIFIER, f"verifier error: {exc!r}"
            )
        result = Verification(
            result.checks,
            result.reward,
            result.failure,
            result.failure_detail,
            (time.perf_counter() - start) * 1000,
            result.safety_events,
        )
        record_verification(task.source, split_name(task.split), result)
        return result

    async def _verify(
        self,
        task: Task,
        answer: str | None,
        session_id: str | None,
        tool_events: Sequence[ToolEvent],
        trajectory_id: str = "",
    ) -> Verification:
        if not task.checks:
            raise CheckInfraError("the task has no checks")
        workspace = None
        if session_id:
            if self.sandbox is None:
                raise CheckInfraError("no sandbox configured")
            workspace = SandboxWorkspace(self.sandbox, session_id, task, self.reference_cache)
            # safety events (and the diff) before any check command adds its own
            await workspace.prepare(read_diff=bool(self.terminal and self.terminal.needs_diff))
        results: list[CheckResult] = []
        for i, check in enumerate(task.checks):
            try:
                result = await run_check(check, answer, workspace, self.limits)
            except CheckInfraError as exc:
                kind = check.WhichOneof("kind")
                return Verification(
                    tuple(results),
                    None,
                    Failure.FAILURE_INFRA_VERIFIER,
                    f"check[{i}] {kind} could not run: {exc}",
                )
            metrics.record_check(result.type, result.passed, result.duration_ms / 1000)
            results.append(result)
        sandbox_events = workspace.safety_events if workspace else []
        flagged = safety_flagged(tool_events, sandbox_events)
        rules = tuple(sorted({str(e.get("rule") or "") for e in sandbox_events} - {""}))
        terminal, weights = {}, {}
        if self.terminal is not None:
            violations = set(rules) | {
                e.policy_rule or e.policy_verdict
                for e in tool_events
                if e.policy_verdict in SAFETY_VERDICTS
            }
            if flagged and not violations:
                violations = {"unnamed"}
            terminal = await self.terminal.components(
                task,
                tool_events,
                sorted(violations),
                workspace.diff if workspace else None,
                trajectory_id,
            )
            weights = self.terminal.weights.enabled()
        reward = compute_reward(
            [r.passed for r in results], tool_events, flagged, self.shaping, terminal, weights
        )
        return Verification(tuple(results), reward, safety_events=rules)


def record_verification(source: str, split: str, result: Verification) -> None:
    """Metrics of one finished verification (services/verifier/metrics.py): its wall time, the
    outcome by task source and split (pass / fail / infra), reward histograms when scored, the
    check type that could not run when INFRA."""
    metrics.VERIFICATION_SECONDS.observe(result.duration_ms / 1000)
    if result.reward is None:  # unscored: FAILURE_INFRA_VERIFIER, the one failure made here
        outcome = "infra"
        metrics.FAILURES.labels(_failed_type(result.failure_detail)).inc()
    else:
        outcome = "pass" if result.reward.reward == 1.0 else "fail"
        metrics.REWARD.observe(result.reward.reward)
        metrics.TRAINING_REWARD.observe(result.reward.training_reward)
        for name, value in result.reward.components.items():
            metrics.REWARD_COMPONENT.labels(name).observe(value)
    labels = (_label(source, "unknown"), _label(split, "unspecified"), outcome)
    metrics.VERIFICATIONS.labels(*labels).inc()


def _label(text: str, default: str) -> str:
    return (text or default)[:64]


def _failed_type(detail: str) -> str:
    """The check type named in an INFRA detail ("check[1] file_sha256 could not run: ...")."""
    parts = detail.split(" ")
    return parts[1] if len(parts) > 2 and parts[0].startswith("check[") else ""
