"""Build real shellrl.v1.Trajectory messages for learner tests."""

from __future__ import annotations

import uuid

from shellrl.contract import (
    Failure,
    SamplingParams,
    Trajectory,
    action_segment,
    encode_token_ids,
    observation_segment,
)


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
    segments = []
    for i, action in enumerate(actions):
        segments.append(
            action_segment(
                list(action),
                [logprob] * len(action),
                version,
                sampling=SamplingParams(temperature=temperature, top_p=1.0, max_new_tokens=8),
            )
        )
        if i < len(actions) - 1 and i < len(observations):
            segments.append(observation_segment(list(observations[i])))
    return Trajectory(
        trajectory_id=trajectory_id or uuid.uuid4().hex,
        group_id=group_id,
        group_size=group_size,
        prompt_ids=encode_token_ids(list(prompt)),
        segments=segments,
        reward=reward,
        training_reward=reward,
        failure=failure,
        scored=scored,
        task_id=f"task-{group_id}",
    )


def engine_version(weight_version: str) -> int:
    """Engine weight_version string -> policy version ("default" is the initial weights: 0)."""
    return 0 if weight_version in ("default", "") else int(weight_version)


async def sample_group(
    client,
    prompt_ids,
    group_id: str,
    group_size: int,
    *,
    temperature: float = 1.0,
    max_new_tokens: int = 4,
    reward_fn=None,
    top_k: int = -1,
) -> list[Trajectory]:
    """G real samples from a running engine: one ACTION segment each, with the engine's behavior
    log-probs and weight version; reward = reward_fn(output_ids) (default: alternating 1, 0)."""
    import asyncio

    sampling = {
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "top_k": top_k,
        "top_p": 1.0,
    }
    results = await asyncio.gather(
        *(client.generate(list(prompt_ids), sampling) for _ in range(group_size))
    )
    out = []
    for i, r in enumerate(results):
        reward = float(reward_fn(r.output_ids)) if reward_fn else float(i % 2 == 0)
        seg = action_segment(
            r.output_ids,
            r.output_logprobs,
            engine_version(r.weight_version),
            sampling=SamplingParams(
                temperature=temperature, top_p=1.0, top_k=top_k, max_new_tokens=max_new_tokens
            ),
        )
        out.append(
            Trajectory(
                trajectory_id=f"{group_id}-{i}",
                group_id=group_id,
                group_size=group_size,
                prompt_ids=encode_token_ids(list(prompt_ids)),
                segments=[seg],
                reward=reward,
                training_reward=reward,
                scored=True,
                task_id=f"task-{group_id}",
            )
        )
    return out
