"""Build real shellrl.v1.Trajectory messages for learner tests."""

from __future__ import annotations

import uuid

from shellrl.contract import Failure, SamplingParams, Trajectory, action_segment, observation_segment


def make_trajectory(
    group_id: str,
    reward: float,
    *,
    trajectory_id: str | None = None,
    group_size: int = 4,
    version: int = 0,
    prompt=(1, 2, 3),
    actions=((10, 11),),
    observations=((20,),),
    logprob: float = -1.0,
    temperature: float = 1.0,
    failure: int = Failure.FAILURE_NONE,
    scored: bool = True,
) -> Trajectory:
    """Prompt, then ACTION segments interleaved with OBSERVATION segments (one fewer)."""
    from shellrl.contract import encode_token_ids

    segments = []
    for i, action in enumerate(actions):
        segments.append(action_segment(list(action), [logprob] * len(action), version,
                                       sampling=SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=8)))
        if i < len(actions) - 1 and i < len(observations):
            segments.append(observation_segment(list(observations[i])))
    return Trajectory(
        trajectory_id=trajectory_id or uuid.uuid4().hex, group_id=group_id, group_size=group_size,
        prompt_ids=encode_token_ids(list(prompt)), segments=segments, reward=reward, training_reward=reward,
        failure=failure, scored=scored, task_id=f"task-{group_id}",
    )
