"""FAKE agent loop: replaces `services.rollout.agent_loop.AgentLoop` (engine + sandbox episodes)
with canned trajectories, to put chosen failures at chosen places of a group.

`ScriptedAgent(answer, engine_failures, keep_session)`: every episode answers `answer` in one
ACTION segment (two tokens, policy version 0). The sample indices in `engine_failures` fail with
FAILURE_INFRA_ENGINE at attempt 0 (the gateway re-runs them); the indices in `keep_session` carry
a sandbox session id, which a verifier without a sandbox cannot inspect (FAILURE_INFRA_VERIFIER).
"""

from __future__ import annotations

from shellrl.contract import EpisodeEnd, Failure, Trajectory, action_segment, encode_token_ids


class ScriptedAgent:
    def __init__(
        self,
        answer: str,
        *,
        engine_failures: frozenset[int] = frozenset(),
        keep_session: frozenset[int] = frozenset(),
    ) -> None:
        self.answer, self.engine_failures, self.keep_session = answer, engine_failures, keep_session
        self.runs: list[str] = []  # trajectory ids, in the order the gateway ran them

    async def run(self, spec) -> Trajectory:
        """One canned episode of `spec` (an EpisodeSpec); the sample index is read from the id."""
        index = int(spec.trajectory_id.split("-")[-2])
        self.runs.append(spec.trajectory_id)
        traj = Trajectory(
            trajectory_id=spec.trajectory_id,
            task_id=spec.task.task_id,
            group_id=spec.group_id,
            group_size=spec.group_size,
            attempt=spec.attempt,
            prompt_ids=encode_token_ids([1, 2]),
        )
        traj.task.CopyFrom(spec.task)
        traj.segments.append(action_segment([5, 6], [-0.1, -0.2], policy_version=0))
        if index in self.engine_failures and spec.attempt == 0:
            traj.failure = Failure.FAILURE_INFRA_ENGINE
            traj.failure_detail = "engine: scripted outage"
            traj.end = EpisodeEnd.EPISODE_END_FAILURE
            return traj
        traj.answer, traj.end, traj.terminated = self.answer, EpisodeEnd.EPISODE_END_ANSWER, True
        if index in self.keep_session:
            traj.sandbox_session_id = f"session-{spec.trajectory_id}"
        return traj
