"""Success bodies of the rollout gateway's HTTP API (routes.py, evaluation_routes.py,
run_routes.py), as the `response_model`s that document them in /openapi.json; schemas.py holds
the request bodies.

Each model lists the keys its route answers, with their JSON types; the routes return the views
that task_store.py, transcripts.py, evaluations.py and runs.py build, and FastAPI validates them
against these models. Every model allows extra keys (a view may grow a key before its model does:
it is answered, not dropped) and the routes answer with `response_model_exclude_unset`, so a key a
view leaves out (`task` in a task list, `task_id` for a list of submitted tasks, `per_task` in an
evaluation list) stays out rather than appearing as null. Times are unix seconds.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Answer(BaseModel):
    """Base of every success body: extra keys are kept as they are."""

    model_config = ConfigDict(extra="allow")


# ---- tasks -----------------------------------------------------------------------------------
class TaskSubmitted(Answer):
    task_id: str
    status: Literal["created", "duplicate"] = Field(
        description="`duplicate`: the same content was already stored under this id."
    )
    split: str


class TasksSubmitted(Answer):
    """POST /v1/tasks."""

    tasks: list[TaskSubmitted] = Field(description="One entry per task, in the body's order.")
    created: int
    duplicates: int
    task_id: str | None = Field(None, description="The task's id; only for a one-task body.")


class TaskEpisodes(Answer):
    started: int
    finished: int
    failed: int
    in_flight: int
    scored: int


class TaskRewards(Answer):
    mean: float | None = Field(description="Mean reward of the scored episodes; null before one.")
    successes: int
    success_rate: float | None = Field(description="successes / scored; null before one.")
    last: float | None = Field(description="The last scored reward; null before one.")


class TaskView(Answer):
    """GET /v1/tasks/{task_id}; an item of GET /v1/tasks (without `task`)."""

    task_id: str
    state: str = Field(description="`queued`, `pooled`, `held_out` or `retired`.")
    split: str
    source: str
    tags: list[str]
    created_at: float
    episodes: TaskEpisodes
    rewards: TaskRewards
    policy_versions: dict[str, int] = Field(description="Episodes per policy version that ran.")
    failures: dict[str, int] = Field(description="Failed episodes per failure class.")
    task: dict[str, Any] | None = Field(
        None, description="The task's JSON form (only in GET /v1/tasks/{task_id})."
    )


class TaskPage(Answer):
    """GET /v1/tasks."""

    tasks: list[TaskView]
    next_cursor: int | None = Field(description="`cursor` of the next page; null on the last.")
    total: int = Field(description="Tasks of the split asked for (all splits: every task).")


# ---- trajectories ----------------------------------------------------------------------------
class ToolView(Answer):
    command: str
    exit_code: int
    duration_ms: float
    timed_out: bool
    stdout_truncated_bytes: int
    stderr_truncated_bytes: int
    policy_verdict: str
    policy_rule: str
    parse_error: str


class SegmentView(Answer):
    kind: Literal["action", "observation"]
    text: str = Field(description="The tokens decoded.")
    token_ids: list[int]
    policy_version: int = Field(description="The version that sampled it; -1 for observations.")
    finish_reason: str
    tool: ToolView | None = Field(None, description="The command's result (observations only).")


class TurnView(Answer):
    turn: int
    segments: list[SegmentView]


class PromptView(Answer):
    text: str
    token_ids: list[int]


class CheckView(Answer):
    type: str
    passed: bool
    detail: str
    duration_ms: float


class VersionsView(Answer):
    env: str
    harness: str
    verifier: str


class Transcript(Answer):
    """GET /v1/trajectories/{trajectory_id}: one finished trajectory as the policy saw it."""

    trajectory_id: str
    task_id: str
    group_id: str
    attempt: int
    eval: bool
    evaluation_id: str
    split: str
    source: str
    stream: str = Field(description="The Redis stream it was read from.")
    entry_id: str
    versions: VersionsView
    task: dict[str, Any] | None = Field(description="The task's JSON form as the gateway ran it.")
    prompt: PromptView
    turns: list[TurnView]
    num_turns: int
    answer: str
    end: str = Field(description="How the episode ended: `answer`, `max_turns`, `failure`, ...")
    terminated: bool
    truncated: bool
    scored: bool
    reward: float | None = Field(description="Null when unscored.")
    training_reward: float | None
    reward_components: dict[str, float | None]
    checks: list[CheckView] = Field(description="The verifier's per-check results, task order.")
    failure: str = Field(description="Failure class, lower case; `none` when none.")
    failure_detail: str
    safety_events: list[str]
    policy_versions: list[int] = Field(description="Distinct versions of the actions, ascending.")
    created_at: float
    finished_at: float
    scored_at: float


class TrajectorySummary(Answer):
    trajectory_id: str
    stream: str
    entry_id: str
    eval: bool
    evaluation_id: str
    scored: bool
    reward: float | None = Field(description="Null when unscored.")
    failure: str
    checks_passed: int
    checks: int = Field(description="How many checks ran.")
    finished_at: float


class TrajectoryList(Answer):
    """GET /v1/trajectories?task_id=: newest first."""

    task_id: str
    trajectories: list[TrajectorySummary]


# ---- status ----------------------------------------------------------------------------------
class AdmissionView(Answer):
    groups_admitted: int
    bound: int = Field(description="Groups that may be admitted at the current policy version.")
    groups_in_flight: int
    oldest_in_flight_version: int | None
    max_staleness: int
    groups_per_step: int
    strict: bool
    can_admit: bool


class PoolView(Answer):
    tasks: int
    epoch: int


class StreamsView(Answer):
    episodes_backlog_verifier: int
    episodes_backlog_bound: int


class GatewayStatus(Answer):
    """GET /v1/status."""

    policy_version: int = Field(description="The learner's, as admission reads it.")
    admission: AdmissionView
    episodes_in_flight: int
    episode_slots_taken: int
    max_episodes_in_flight: int
    trajectories_published: int
    uptime_s: float
    pool: PoolView
    tasks: dict[str, int] = Field(description="`total`: tasks stored.")
    streams: StreamsView
    infra_down: list[str] = Field(description="Infrastructure the gate holds as down now.")
    sandbox_health: dict[str, Any] = Field(description="Score, threshold, whether slowed.")
    worker_enabled: bool
    engines: dict[str, Any] = Field(description="Routing floor and each engine's state.")
    sandboxes: dict[str, Any] = Field(description="Each sandbox member's load and state.")


# ---- evaluations -----------------------------------------------------------------------------
class SamplingView(Answer):
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int


class TaskOutcomes(Answer):
    episodes: int
    successes: int
    scored: int
    outcomes: dict[str, int]
    success_rate: float | None


class EvaluationView(Answer):
    """GET /v1/evaluations/{evaluation_id} (an item of GET /v1/evaluations: no `per_task`,
    `results`). Outcomes: `success`, `wrong` or a failure class."""

    evaluation_id: str
    split: str | None
    task_ids: list[str]
    episodes_per_task: int
    sampling: SamplingView
    max_turns: int | None
    policy_version: int = Field(description="The policy version at the start.")
    budget_episodes: int
    state: str = Field(description="`running`, `done`, `failed` or `interrupted`.")
    created_at: float
    finished_at: float | None
    episodes_done: int
    episodes_scored: int
    success_rate: float | None
    mean_reward: float | None
    outcomes: dict[str, int]
    failures: dict[str, int] = Field(description="The outcomes that are failure classes.")
    policy_versions_seen: list[int]
    mixed_versions: bool
    per_task: dict[str, TaskOutcomes] | None = Field(None, description="By task id.")
    results: list[dict[str, Any]] | None = Field(
        None, description="One per episode: task_id, episode, outcome, reward, answer, ..."
    )


class EvaluationList(Answer):
    """GET /v1/evaluations: newest first."""

    evaluations: list[EvaluationView]


# ---- training runs ---------------------------------------------------------------------------
class RunSubmitted(Answer):
    created: int
    duplicates: int
    repooled: int = Field(description="Stored tasks that were out of the pool and went back.")


class RunEpisodes(Answer):
    finished: int
    failed: int
    scored: int
    successes: int
    success_rate: float | None
    mean_reward: float | None


class RunView(Answer):
    """GET /v1/runs/{run_id}, POST /v1/runs, POST /v1/runs/{run_id}/stop; counts are since the
    run's start."""

    run_id: str
    steps: int
    time_budget_s: float | None
    name: str | None
    task_file: str | None
    tasks: int = Field(description="Distinct tasks of the train set.")
    submitted: RunSubmitted
    start_policy_version: int
    target_policy_version: int
    start_groups_admitted: int
    state: str = Field(description="`training`, `done`, `time_up` or `stopped`.")
    created_at: float
    finished_at: float | None
    elapsed_s: float
    policy_version: int
    steps_done: int
    progress: float = Field(description="steps_done / steps, 0..1.")
    groups_admitted: int
    episodes: RunEpisodes


class RunList(Answer):
    """GET /v1/runs: newest first."""

    runs: list[RunView]
