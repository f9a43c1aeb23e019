"""What one episode is asked to do: its task and ids (`EpisodeSpec`), its group's sampling
(`Sampling`, the one type of the sampling parameters from the HTTP API to the episode; `to_proto`
gives the trajectory's SamplingParams), and the limits every episode runs under (`EpisodeLimits`,
from the gateway's settings). agent_loop.py runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.rollout.settings import check_top_k
from shellrl.contract import SamplingParams, Task


class Sampling(BaseModel):
    """One group's sampling parameters (every episode of a group uses the same): the `sampling`
    of a POST /v1/evaluations body (FastAPI validates it: 422 naming the field, e.g.
    `sampling.top_k`; its defaults are the API's) and the training episodes' (parts.py builds
    them from RolloutSettings; `ValidationError` at start-up past the bounds below). An episode's
    `max_new_tokens` is always set; `None` only in a request body, for the gateway's setting.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 (disabled) or >= 1; SGLang refuses 0.")
    max_new_tokens: int | None = Field(
        None, ge=1, le=4096, description="Default: the gateway's max_new_tokens."
    )

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        return check_top_k(value)

    def to_proto(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
        )


DEFAULT_SAMPLING = Sampling(temperature=1.0, max_new_tokens=40)
"""An episode's sampling when its maker gives none: RolloutSettings' defaults."""


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 3  # when the task says 0
    max_context_tokens: int = 2048  # prompt + segments
    max_observation_chars: int = 600  # per stream (stdout, stderr)
    exec_timeout_s: float = 10.0
    episode_timeout_s: float = 600.0
    max_continuations: int = 32  # aborted-and-continued requests per turn
    sandbox_busy_poll_s: float = 0.5
    sandbox_policy: str = ""
    pin_engine: bool = True  # every request of an episode to the engine of its first one
    max_engine_failovers: int = 2  # moves to another engine per episode after its engine failed


@dataclass(frozen=True)
class EpisodeSpec:
    task: Task
    trajectory_id: str
    group_id: str = ""
    group_size: int = 1
    attempt: int = 0
    sampling: Sampling = DEFAULT_SAMPLING
    admitted_at: float = 0.0
    eval: bool = False
    evaluation_id: str = ""
    keep_session: bool = (
        True  # False: delete the session at the end (the caller verifies first otherwise)
    )
    seed: int | None = None  # each request's sampling_seed derives from it (seeding.py)
