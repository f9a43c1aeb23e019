"""Settings of the verifier service (environment `SHELLRL_<FIELD>`, see shellrl.service.settings)."""

from __future__ import annotations

import math
from typing import ClassVar

from pydantic import Field, ValidationInfo, field_validator

from shellrl.service.settings import ServiceSettings


class VerifierSettings(ServiceSettings):
    """Everything the verifier reads. Units are in the field names."""

    default_port: ClassVar[int] = 8102

    sandbox_url: str = Field(
        "http://127.0.0.1:8101",
        description="Sandbox service the checks run in, or a comma-separated list (the rollout "
        "gateway's sandbox_url: sessions are routed by id, shellrl/clients/sandbox_fleet.py).",
    )
    sandbox_registry: bool = Field(
        False,
        description="Also use the sandbox services that register themselves in "
        "shellrl:sandboxes at redis_url (they join and leave at run time; sandbox_url may then "
        "be ''). The rollout gateway and the verifier must agree on it.",
    )
    consumer_name: str = Field(
        "", description="Consumer name in group `verifier`; '' = verifier-<hostname>-<pid>."
    )
    worker_enabled: bool = Field(
        True, description="Consume shellrl:episodes (off: only POST /v1/verify)."
    )
    concurrency: int = Field(
        8, ge=1, le=256, description="Trajectories verified at the same time by the worker."
    )
    read_count: int = Field(16, ge=1, le=512, description="Entries per XREADGROUP.")
    trajectories_stream_maxlen: int = Field(
        100_000,
        ge=1,
        description="shellrl:trajectories is trimmed past this many entries, those every group "
        "(the learner, the gateway's task statistics) acknowledged only: without it the stream "
        "kept every scored trajectory for good, ~7 kB each, Redis memory growing with the "
        "cluster and the run (issue 35, BENCHMARKS.md). Transcripts of trimmed ones are gone.",
    )
    block_ms: int = Field(
        1000, gt=0, lt=5000, description="Blocking read time of the stream consumer, ms."
    )
    claim_min_idle_ms: int = Field(
        20_000,
        ge=100,
        description="Idle time after which another replica's entry is re-claimed, ms. The rule "
        "(the learner's too): longer than a live consumer holds an entry unrenewed, so only a dead "
        "consumer's entries are re-claimed. One verification can run for hours (up to "
        "LIMITS['checks'] checks of up to 3600 s each), so the worker renews the entries it is "
        "verifying every claim_min_idle_ms / 4 (StreamConsumer.keep_renewed) and this bounds only "
        "a stalled event loop; short, because a killed verifier's entries (a restart has a new "
        "consumer name) wait this long: 20 s tolerates a 15 s stall, and recovery stays well "
        "inside the 60 s a fault may pause training. A read whose reply the client lost needs no "
        "re-claim: the next read re-reads this consumer's own pending entries.",
    )
    max_deliveries: int = Field(
        5, ge=1, description="Deliveries after which a failing entry goes to shellrl:dead."
    )
    check_timeout_s: float = Field(
        10.0, gt=0, le=600, description="Timeout of a check whose own timeout_s is 0, s."
    )
    max_file_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        description="Largest file file_contains/file_sha256 read; larger fails the check.",
    )
    max_answer_chars: int = Field(
        65_536, ge=1, description="Answers longer than this fail answer checks."
    )
    reference_cache_size: int = Field(
        1024, ge=0, description="reference_command outputs cached (per setup, env, command)."
    )
    release_sessions: bool = Field(
        True, description="DELETE the sandbox session after scoring a trajectory."
    )
    shaping_enabled: bool = Field(
        False, description="Add the shaping components into training_reward (off by default)."
    )
    shaping_exit_zero_bonus: float = Field(
        0.1, description="Shaping: added per command that exited 0."
    )
    shaping_exit_zero_cap: float = Field(
        0.3, ge=0, description="Shaping: cap of the exit-0 bonus sum."
    )
    shaping_timeout_penalty: float = Field(
        -0.1, description="Shaping: added per command that timed out."
    )
    shaping_safety_penalty: float = Field(
        -1.0, description="Shaping: added once when the sandbox policy flagged or denied a command."
    )
    require_command: bool = Field(
        False,
        description="A success whose episode sent no command to the sandbox trains as 0 "
        "(reward component ungrounded_success; reward stays 1). Independent of shaping_enabled; "
        "the main job turns it on.",
    )

    # Reward components of a real terminal (reward_components.py): weight 0 = off (the default).
    reward_safety_weight: float = Field(
        0.0, ge=0, description="Weight of `safety` (escalating -5/-8 penalty) in training_reward."
    )
    reward_safety_penalty: float = Field(
        -5.0, le=0, description="safety: penalty of a violation before the escalation."
    )
    reward_safety_escalated_penalty: float = Field(
        -8.0, le=0, description="safety: penalty once reward_safety_escalate_after_steps passed."
    )
    reward_safety_escalate_after_steps: int = Field(
        100, ge=1, description="safety: commands without a violation after which it escalates."
    )
    reward_safety_run: str = Field(
        "default",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_.:-]+$",
        description="safety: run whose escalation state (Redis shellrl:verifier:safety:<run>) "
        "this verifier shares with its replicas and restarts.",
    )
    reward_state_drift_weight: float = Field(
        0.0, ge=0, description="Weight of `state_drift` (files changed outside the outputs)."
    )
    reward_state_drift_max_paths: int = Field(
        10, ge=1, description="state_drift: drifted paths at which it reaches -1."
    )
    reward_time_efficiency_weight: float = Field(
        0.0, ge=0, description="Weight of `time_efficiency` (command time over the budget)."
    )
    reward_time_budget_s: float = Field(
        60.0, gt=0, description="time_efficiency: budget of a task without a time_budget_s: tag, s."
    )

    @field_validator("*")
    @classmethod
    def _finite(cls, value, info: ValidationInfo):
        """Every reward and shaping number and check_timeout_s is finite (a new component's
        reward_<name>_weight included, with no list to extend)."""
        name = info.field_name or ""
        checked = name.startswith(("reward_", "shaping_")) or name == "check_timeout_s"
        if checked and isinstance(value, float) and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value
