"""What one episode is asked to do: its task and ids (`EpisodeSpec`), its group's sampling
(`Sampling`, the API's sampling parameters; `to_proto` gives the trajectory's SamplingParams),
and the limits every episode runs under (`EpisodeLimits`, from the gateway's settings).
agent_loop.py runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shellrl.contract import SamplingParams, Task


@dataclass(frozen=True)
class Sampling:
    """One group's sampling config (every episode of a group uses the same)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 40

    def to_proto(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
        )


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
    sampling: Sampling = field(default_factory=Sampling)
    admitted_at: float = 0.0
    eval: bool = False
    evaluation_id: str = ""
    keep_session: bool = (
        True  # False: delete the session at the end (the caller verifies first otherwise)
    )
    seed: int | None = None  # each request's sampling_seed derives from it (seeding.py)
