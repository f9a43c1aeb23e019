"""Settings of the sandbox executor (`SHELLRL_*` environment variables, see `SandboxSettings`)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import AliasChoices, Field

from shellrl.service.settings import ServiceSettings

IsolationChoice = Literal["auto", "bubblewrap", "unshare", "fallback"]


class SandboxSettings(ServiceSettings):
    """Configuration of `services.sandbox`; read once in `__main__`."""

    default_port: ClassVar[int] = 8101

    workspace_root: Path = Field(
        Path(tempfile.gettempdir()) / "shellrl-sandbox",
        description="Host directory holding one directory per session (tmpfs/overlay mounts live below it).",
    )
    isolation: IsolationChoice = Field(
        "auto",
        validation_alias=AliasChoices(
            "isolation", "SHELLRL_SANDBOX_ISOLATION", "SHELLRL_ISOLATION"
        ),
        description="Isolation layer: auto = best that the start-up probe finds; others force one layer.",
    )
    exec_mode: Literal["session", "per_command"] = Field(
        "session",
        validation_alias=AliasChoices(
            "exec_mode", "SHELLRL_SANDBOX_EXEC_MODE", "SHELLRL_EXEC_MODE"
        ),
        description="session: one long-lived sandbox + runner per session, a fresh bash per command (background "
        "processes live on); per_command: a fresh sandbox per command (see BENCHMARKS.md for the measurement).",
    )
    max_sessions: int = Field(
        64, ge=1, le=1024, description="Live sessions; one more gets HTTP 429."
    )
    session_ttl_s: float = Field(
        1800.0, gt=0, description="Idle time after which a session is removed."
    )
    ttl_sweep_interval_s: float = Field(
        10.0, gt=0, description="How often expired sessions are looked for."
    )
    default_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="Wall-clock limit of one exec."
    )
    max_timeout_s: float = Field(
        600.0, gt=0, le=3600, description="Largest timeout_s a request may ask for."
    )
    setup_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="Wall-clock limit of a session's setup script."
    )
    max_output_bytes: int = Field(
        65536,
        ge=1024,
        le=16 << 20,
        description="Bytes of stdout (and, separately, stderr) kept per exec.",
    )
    max_command_bytes: int = Field(
        4 << 20, ge=1024, description="Largest accepted command (UTF-8 bytes)."
    )
    max_concurrent_execs: int = Field(
        32, ge=1, description="Commands running at once across all sessions."
    )
    policy_file: Path | None = Field(
        None, description="YAML policy file; None = the packaged default.yaml."
    )
    default_policy: str = Field(
        "default", description="Policy name used when a session names none."
    )
    allow_network_policies: bool = Field(
        False,
        description="Let sessions use policies with `network: true` (the host network, loopback "
        "services included); off: asking for one is a 403 naming `policy`.",
    )
    egress_header_timeout_s: float = Field(
        10.0, gt=0, le=300, description="Egress proxy: a request head must arrive within this."
    )
    egress_max_header_bytes: int = Field(
        32 << 10, ge=1024, le=1 << 20, description="Egress proxy: largest request head (else 431)."
    )
    egress_connect_timeout_s: float = Field(
        10.0, gt=0, le=300, description="Egress proxy: name lookup plus upstream TCP connect."
    )
    egress_idle_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="Egress proxy: an exchange with no byte moving ends."
    )
    uid_base: int = Field(
        200000,
        ge=1000,
        description="First uid of the per-session uid blocks (each instance locks one block).",
    )
    uid_block_size: int = Field(1024, ge=1, description="Uids per block; must be >= max_sessions.")
    cgroup_root: Path = Field(
        Path("/sys/fs/cgroup"),
        description="cgroup mount root: a v2 mount (memory, pids, cpu delegated) or the directory "
        "of the v1 hierarchies (pids, memory, freezer; cpu optional).",
    )
    # All sessions of this instance together (the parent cgroup), as fractions of the host.
    sessions_memory_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Memory of all sessions together: this fraction of the host's (MemTotal, or "
        "the service's own cgroup limit where lower).",
    )
    sessions_pids_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Processes of all sessions together: this fraction of min(pid_max, "
        "threads-max).",
    )
    sessions_cpu_fraction: float = Field(
        0.75,
        gt=0,
        le=1,
        description="CPU time of all sessions together: this fraction of the host's CPUs (or of "
        "the service's own CPU quota).",
    )
    admission_session_memory_bytes: int = Field(
        256 << 20,
        ge=0,
        description="A new session gets 429 (Retry-After) while less memory than this is free for "
        "sessions (the parent cgroup's and the host's MemAvailable, the lower).",
    )
    admission_exec_memory_bytes: int = Field(
        32 << 20, ge=0, description="A command gets 429 (Retry-After) below this much free memory."
    )
    admission_retry_after_s: int = Field(
        2, ge=1, le=600, description="Retry-After (seconds) of a 429 for lack of headroom."
    )
    # Terminal health score (host/health.py): weights of its parts (ours: the write-up gives none).
    health_weight_load: float = Field(0.3, ge=0, description="Weight of the load sub-score.")
    health_weight_memory: float = Field(0.3, ge=0, description="Weight of the memory sub-score.")
    health_weight_disk: float = Field(0.2, ge=0, description="Weight of the disk sub-score.")
    health_weight_latency: float = Field(
        0.2, ge=0, description="Weight of the exec-latency sub-score."
    )
    health_max_load_per_cpu: float = Field(
        2.0, gt=0, description="1-min load per CPU at which the load sub-score reaches 0."
    )
    health_max_exec_latency_s: float = Field(
        1.0, gt=0, description="p90 exec overhead (s) at which the latency sub-score reaches 0."
    )
    health_interval_s: float = Field(
        5.0, gt=0, description="How often the health gauges are sampled (s)."
    )
    register_url: str = Field(
        "",
        validation_alias=AliasChoices("register_url", "SHELLRL_SANDBOX_REGISTER_URL"),
        description="Where rollout gateways and verifiers reach this service (e.g. http://<pod "
        "ip>:8101): when set, it registers itself in shellrl:sandboxes at redis_url while it "
        "serves (registration.py); '' = no registration (list it in their SHELLRL_SANDBOX_URL).",
    )
    register_heartbeat_s: float = Field(
        2.0,
        gt=0,
        validation_alias=AliasChoices(
            "register_heartbeat_s", "SHELLRL_SANDBOX_REGISTER_HEARTBEAT_S"
        ),
        description="Seconds between registry heartbeats; live for 3 of them.",
    )
    warm_pool_per_setup: int = Field(
        0,
        ge=0,
        le=64,
        description="Ready sessions kept per repeating task setup (sessions/warm_pool.py); 0 = no warm pool.",
    )
    warm_pool_max_sessions: int = Field(
        16, ge=0, le=1024, description="Ready sessions in the warm pool across all setups."
    )
    warm_pool_min_repeats: int = Field(
        2, ge=1, description="Creates asking for one setup before it is kept warm."
    )
    warm_pool_reserve_sessions: int = Field(
        2, ge=0, description="Free session slots the warm pool never fills (left for requests)."
    )
    # Default per-session limits (a session may ask for others within the bounds of `Limits`).
    cpu_s: int = Field(60, ge=1, description="RLIMIT_CPU per process, seconds.")
    memory_bytes: int = Field(
        1 << 30, ge=16 << 20, description="Session memory cgroup limit (includes tmpfs)."
    )
    address_space_bytes: int = Field(4 << 30, ge=64 << 20, description="RLIMIT_AS per process.")
    pids: int = Field(
        256, ge=8, description="Processes per session (cgroup pids.max and RLIMIT_NPROC)."
    )
    file_size_bytes: int = Field(256 << 20, ge=1 << 20, description="RLIMIT_FSIZE per file.")
    workspace_bytes: int = Field(
        256 << 20, ge=1 << 20, description="Size of the workspace (+ /tmp) tmpfs."
    )
    nofile: int = Field(1024, ge=64, description="RLIMIT_NOFILE.")
    cpus: float = Field(
        1.0, gt=0, le=1024, description="CPU quota per session (cgroup cpu.max), in CPUs."
    )
