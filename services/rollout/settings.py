"""Settings of the rollout gateway (`SHELLRL_*` environment variables, see shellrl.service.settings).

Defaults suit SmolLM2-135M on a 2-core CPU (../shared/reference/feasibility.md: group 8,
4 groups per step, 40 new tokens per turn, 3 turns, temperature 1.0, a one-shot example).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, field_validator

from shellrl.service.settings import TrainingScheduleSettings


class RolloutSettings(TrainingScheduleSettings):
    """The gateway's settings; groups_per_step, max_staleness and dynamic_sampling are the
    learner's too (`TrainingScheduleSettings`)."""

    default_port: ClassVar[int] = 8100

    # where the other services are
    sandbox_url: str = Field(
        "http://127.0.0.1:8101",
        description="Sandbox service base URL, or a comma-separated list of them (one per host: "
        "new sessions go by load, later calls to the owner; shellrl/clients/sandbox_fleet.py). "
        "The verifier's sandbox_url must list the same URLs.",
    )
    sandbox_registry: bool = Field(
        False,
        description="Also use the sandbox services that register themselves in "
        "shellrl:sandboxes at redis_url (they join and leave at run time; sandbox_url may then "
        "be ''). The rollout gateway and the verifier must agree on it.",
    )
    verifier_url: str = Field(
        "http://127.0.0.1:8102", description="Verifier base URL (POST /v1/verify, evaluations)."
    )
    model_path: str = Field(
        "smollm2", description="Tokenizer / chat template: 'smollm2', 'tiny' or a HF directory."
    )

    # GRPO groups and admission (DESIGN.md section 5)
    group_size: int = Field(
        8, ge=1, le=256, description="G: episodes per group (same task, same sampling)."
    )
    strict_staleness: bool = Field(
        True,
        description="Also bound admission by the oldest in-flight group's version, so a long-tail group "
        "can never be overtaken by more than max_staleness steps (see admission.py).",
    )
    pass_rate_steering: bool = Field(
        False,
        description="Pass over (for the epoch) tasks whose template's recent training success "
        "rate is outside [steering_low, steering_high], but for steering_keep_fraction of them "
        "(steering.py).",
    )
    steering_window_episodes: int = Field(
        32, ge=1, description="Training episodes a template's recent pass rate is taken over."
    )
    steering_low: float = Field(0.1, ge=0, le=1, description="Lower end of the band run in full.")
    steering_high: float = Field(0.9, ge=0, le=1, description="Upper end of the band run in full.")
    steering_keep_fraction: float = Field(
        0.25, ge=0, le=1, description="Share of out-of-band tasks still run (exploration)."
    )
    max_episodes_in_flight: int = Field(
        64, ge=1, description="Cap on training episodes running at once."
    )
    episodes_backlog_bound: int = Field(
        512,
        ge=1,
        description="Admission waits while shellrl:episodes has this many entries unacknowledged "
        "by the verifier group.",
    )
    sandbox_health_threshold: float = Field(
        0.45,
        ge=0,
        le=1,
        description="New groups are slowed while the sandbox's terminal health score (its /readyz "
        "health.score) is below this; 0 = never (gates.HealthGate).",
    )
    sandbox_health_delay_s: float = Field(
        2.0, ge=0, le=600, description="Wait before each new group while the score is low, s."
    )
    sandbox_health_refresh_s: float = Field(
        5.0, ge=0, le=600, description="How often admission reads the sandbox health score, s."
    )
    episodes_stream_maxlen: int = Field(
        100_000,
        ge=1,
        description="shellrl:episodes is trimmed past this many entries, acknowledged ones only.",
    )
    pool_seed: int = Field(
        0, description="Seed of the per-epoch shuffle of the training pool and of steering's draws."
    )
    sampling_seed: int | None = Field(
        0,
        description="Seed of every engine request of training and sampled eval episodes: each "
        "request's sampling_seed is derived from it, the task, epoch, sample, turn and "
        "continuation (seeding.py); None = unseeded (the engine's own random state). SGLang "
        "honours it with --enable-deterministic-inference (and ignores it otherwise).",
    )
    worker_enabled: bool = Field(
        True, description="Run the rollout worker (False: REST and evaluations only)."
    )
    consumer_name: str = Field(
        "rollout-0", description="Stable name of this replica (stream consumer, in-flight keys)."
    )
    claim_min_idle_ms: int = Field(
        30_000,
        ge=100,
        description="Idle time after which another replica's entry of shellrl:tasks (the pool "
        "feeder) or shellrl:trajectories (task stats) is re-claimed, ms. The rule (the "
        "learner's too): longer than a live consumer holds an entry, so only a dead consumer's "
        "entries are re-claimed. Both handle an entry with one or two Redis scripts (ms; a batch "
        "of 256 within a second), so this bounds only a stalled loop or a Redis outage mid-batch "
        "(then the next read re-reads this consumer's own pending entries anyway). A restart "
        "under the same consumer_name re-reads its own pending entries at once; under another "
        "name (a new pod) they come back after this idle time.",
    )
    heartbeat_s: float = Field(
        5.0, gt=0, description="Seconds between this replica's heartbeats (replicas.py)."
    )
    replica_dead_after_s: float = Field(
        60.0,
        gt=0,
        description="A replica silent this long is dead: a live one takes over its tasks, "
        "admission and stream consumers. Must exceed the longest pause of a live replica.",
    )

    # one episode
    max_turns: int = Field(3, ge=1, le=64, description="Turns per episode when the task says 0.")
    max_new_tokens: int = Field(40, ge=1, description="New tokens per turn.")
    temperature: float = Field(
        1.0, ge=0.0, description="Sampling temperature of training episodes."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, description="-1 = disabled, else >= 1 (SGLang refuses 0).")
    max_context_tokens: int = Field(
        2048, ge=64, description="Context budget: prompt + all segments, tokens."
    )
    max_observation_chars: int = Field(
        600, ge=16, description="Cap on stdout and on stderr in one observation."
    )
    exec_timeout_s: float = Field(
        10.0, gt=0, description="Wall-clock limit of one command in the sandbox."
    )
    episode_timeout_s: float = Field(
        600.0, gt=0, description="Wall-clock budget of one episode (TIMEOUT_BUDGET)."
    )
    max_attempts: int = Field(
        3, ge=1, description="Attempts of one sample when it fails with an INFRA class."
    )
    retry_backoff_s: float = Field(
        1.0, ge=0, description="Wait before an INFRA retry (doubles per attempt)."
    )
    sandbox_busy_poll_s: float = Field(
        0.5, gt=0, description="Wait between session attempts while the sandbox says 429."
    )
    max_continuations: int = Field(
        32, ge=1, description="Aborted-and-continued requests allowed in one turn."
    )
    sandbox_policy: str = Field(
        "", description="Sandbox policy name for episode sessions ('' = its default)."
    )
    pin_episodes: bool = Field(
        True,
        description="Send every turn of an episode to the engine of its first turn, so its "
        "prefix cache holds the history (agent_loop.py).",
    )
    max_engine_failovers: int = Field(
        2,
        ge=0,
        description="Times one episode moves to another engine after its engine failed or left "
        "(it continues from its exact tokens); past that the episode is an INFRA_ENGINE failure.",
    )
    engine_route_wait_s: float = Field(
        30.0,
        ge=0,
        description="How long a generate waits for a routable engine (registered, updated by the "
        "learner, within the staleness bound) when none is, seconds.",
    )

    # evaluations
    eval_max_in_flight: int = Field(16, ge=1, description="Evaluation episodes running at once.")
    eval_max_episodes: int = Field(
        2048, ge=1, description="Largest episode budget one evaluation may ask for."
    )
    verify_timeout_s: float = Field(120.0, gt=0, description="Timeout of one POST /v1/verify.")

    # training runs (POST /v1/runs, runs.py)
    task_file_dir: str | None = Field(
        None,
        description="Directory POST /v1/runs reads a `task_file` (JSONL) from; the path must "
        "stay inside it. None: runs take inline tasks only.",
    )

    # task statistics
    stats_enabled: bool = Field(
        True,
        description="Consume shellrl:trajectories (group rollout-stats) into task stats and "
        "count the verifier's INFRA failures into admission (keep on wherever "
        "the worker runs).",
    )

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, value: int) -> int:
        return check_top_k(value)


def check_top_k(value: int) -> int:
    """SGLang's rule (sampling_params.py verify): top_k is -1 (disabled) or at least 1; 0 passed
    our gateway and then every generate of the episode was refused by SGLang."""
    if value == 0 or value < -1:
        raise ValueError("top_k must be -1 (disabled) or >= 1")
    return value
