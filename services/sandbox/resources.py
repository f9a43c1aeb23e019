"""Start-up of what bounds the host's share of sessions: the host's size, the sessions' parent
cgroup sized from it, admission, and the /proc view of the chosen layer; and how they report
(log lines, /readyz details, metrics)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from services.sandbox import metrics
from services.sandbox.cgroups.support import CgroupLimits, CgroupSupport
from services.sandbox.host.capacity import HostCapacity
from services.sandbox.host.uids import UidPool
from services.sandbox.isolation import proc_view
from services.sandbox.isolation.layers import Isolation
from services.sandbox.sessions.admission import Admission
from services.sandbox.settings import SandboxSettings

log = logging.getLogger(__name__)


@dataclass
class Resources:
    host: HostCapacity
    cgroups: CgroupSupport
    admission: Admission
    proc: dict = field(default_factory=dict)

    def details(self) -> dict:
        """The static part of /readyz: cgroups (version, parent limits, why not), host, proc."""
        return {
            "cgroups": self.cgroups.available,
            **self.cgroups.details(),
            "host": self.host.as_dict(),
            "proc_view": self.proc,
        }


def parent_limits(host: HostCapacity, settings: SandboxSettings) -> CgroupLimits:
    """All sessions together: the host's size times the `sessions_*_fraction` settings."""
    return CgroupLimits(
        memory_bytes=int(host.memory_bytes * settings.sessions_memory_fraction),
        pids=max(64, int(host.pids * settings.sessions_pids_fraction)),
        cpus=max(0.01, math.floor(host.cpus * settings.sessions_cpu_fraction * 100) / 100),
    )


def _proc_view(isolation: Isolation, private_mounts: bool) -> dict:
    """Reduce what sessions see of the host's /proc (isolation/proc_view.py) and say what was done."""
    files, dirs = isolation.proc_masks
    masked = [f"/proc/{name}" for name in files + dirs]
    if isolation.layer != "fallback":
        return {"processes": "session", "meminfo_loadavg": "session", "masked": masked}
    problem = "no private mount namespace" if not private_mounts else None
    problem = problem or proc_view.hide_other_processes(files, dirs)
    if problem is not None:
        log.warning(
            "fallback: sessions see every host process and the host's /proc details",
            extra={"reason": problem},
        )
        return {"processes": "host", "meminfo_loadavg": "host", "masked": [], "problem": problem}
    return {"processes": "own_uid", "meminfo_loadavg": "host", "masked": masked}


def setup_resources(
    settings: SandboxSettings, uids: UidPool, isolation: Isolation, private_mounts: bool
) -> Resources:
    """Read the host, set up the sessions' parent cgroup (`block-<first uid>` of this instance)
    and admission, mask /proc for the layer; set the metrics. OSError if /proc is unreadable."""
    host = HostCapacity.read(settings.cgroup_root)
    cgroups = CgroupSupport(
        settings.cgroup_root, f"block-{uids.first}", parent_limits(host, settings)
    )
    admission = Admission(
        cgroups,
        host,
        settings.max_sessions,
        settings.admission_session_memory_bytes,
        settings.admission_exec_memory_bytes,
        settings.admission_retry_after_s,
    )
    resources = Resources(host, cgroups, admission, _proc_view(isolation, private_mounts))
    metrics.CGROUP_LIMITS_ENFORCED.set(1 if cgroups.available else 0)
    metrics.PROC_MASKED.set(1 if resources.proc["masked"] else 0)
    log.info("sandbox resources", extra=resources.details())
    return resources
