"""Per-session resource limits: the request shape, the defaults, and their enforcement points."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field


class LimitsRequest(BaseModel):
    """`limits` of POST /v1/sessions; each field overrides the service default (bounded here)."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float | None = Field(
        None, gt=0, le=3600, description="Default wall-clock limit of one exec."
    )
    cpu_s: int | None = Field(None, ge=1, le=3600, description="RLIMIT_CPU, seconds per process.")
    memory_bytes: int | None = Field(
        None, ge=16 << 20, le=64 << 30, description="Session memory cgroup limit."
    )
    address_space_bytes: int | None = Field(
        None, ge=64 << 20, le=1 << 40, description="RLIMIT_AS per process."
    )
    pids: int | None = Field(None, ge=8, le=65536, description="Processes per session.")
    file_size_bytes: int | None = Field(None, ge=1 << 20, le=64 << 30, description="RLIMIT_FSIZE.")
    workspace_bytes: int | None = Field(
        None, ge=1 << 20, le=64 << 30, description="Workspace + /tmp bytes."
    )
    max_output_bytes: int | None = Field(
        None, ge=1024, le=16 << 20, description="Kept bytes per stream."
    )
    cpus: float | None = Field(
        None,
        ge=0.01,
        le=1024,
        description="CPU quota of the session (cgroup cpu.max), in CPUs; at most all sessions' "
        "share (the parent cgroup's quota).",
    )


@dataclass(frozen=True)
class Limits:
    """Resolved limits of one session.

    Enforcement: `timeout_s` by the executor (tree kill), `cpu_s`/`address_space_bytes`/
    `file_size_bytes`/`nofile` as hard rlimits set before the command runs, `pids` by the cgroup
    pids controller and RLIMIT_NPROC of the session's own uid, `memory_bytes` by the memory cgroup,
    `cpus` by the cpu cgroup's quota (CPU seconds per wall-clock second, all the session's processes
    together; where cgroups are missing it is not enforced), `workspace_bytes` by the size of the
    workspace tmpfs, `max_output_bytes` by the output reader. All sessions together stay under
    their parent cgroup's limits (cgroups/support.py).
    """

    timeout_s: float
    cpu_s: int
    memory_bytes: int
    address_space_bytes: int
    pids: int
    file_size_bytes: int
    workspace_bytes: int
    max_output_bytes: int
    nofile: int
    cpus: float = 1.0

    def merged(self, request: LimitsRequest | None) -> Limits:
        if request is None:
            return self
        overrides = {k: v for k, v in request.model_dump().items() if v is not None}
        return Limits(**{**self.__dict__, **overrides})

    def as_dict(self) -> dict:
        return dict(self.__dict__)
