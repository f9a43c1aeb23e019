"""The sandbox's composition root: `build_parts(settings)` is the one place its settings become
constructor arguments (after the start-up checks: root, the uid block, the default policy), and
`Parts` is what the routes (routes.py) and the background loops (lifespan.py) receive.
`parts_over(manager, ...)` wraps a given session manager (tests serve the routes over a stub).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends

from services.sandbox import metrics
from services.sandbox.egress.doors import egress_doors
from services.sandbox.host import mounts
from services.sandbox.host.health import HealthWeights, HostHealth
from services.sandbox.host.uids import UidPool
from services.sandbox.isolation.probe import detect
from services.sandbox.limits import Limits
from services.sandbox.policy import PolicySet
from services.sandbox.resources import setup_resources
from services.sandbox.sessions.manager import SessionManager
from services.sandbox.sessions.warm_pool import WarmPool
from services.sandbox.settings import SandboxSettings
from shellrl.service.parts import parts_dependency

log = logging.getLogger("services.sandbox")


@dataclass
class Parts:
    """The session manager and what serves beside it."""

    manager: SessionManager
    warm_pool: WarmPool  # every create goes through it (per_setup 0: none kept warm)
    health: HostHealth  # sampled every health_interval_s, served in /readyz
    config: dict  # served at GET /v1/config
    ready_details: dict  # served at /readyz, with the live counts
    ttl_sweep_interval_s: float  # how often expired sessions are looked for
    health_interval_s: float = 5.0
    allow_network_policies: bool = False  # else a `network: true` policy is 403


PartsDep = Annotated[Parts, Depends(parts_dependency(Parts))]
"""A route's parameter `parts: PartsDep` receives the app's Parts (shellrl/service/parts.py)."""


def parts_over(
    manager: SessionManager,
    config: dict,
    ready_details: dict,
    ttl_sweep_interval_s: float,
    *,
    allow_network_policies: bool = False,
    warm_pool: WarmPool | None = None,
    health: HostHealth | None = None,
    health_interval_s: float = 5.0,
) -> Parts:
    """Parts around `manager` (`warm_pool` None: none kept; `health` None: default weights over
    manager.root); the manager reports each exec's overhead to `health`."""
    health = health or HostHealth(manager.root)
    manager.on_exec_overhead = health.observe_exec
    pool = warm_pool or WarmPool(
        manager, per_setup=0, max_sessions=0, min_repeats=1, reserve_sessions=0
    )
    return Parts(
        manager,
        pool,
        health,
        config,
        ready_details,
        ttl_sweep_interval_s,
        health_interval_s,
        allow_network_policies,
    )


def build_parts(settings: SandboxSettings) -> Parts:
    """Check the settings and the host, enter a private mount namespace, probe the isolation
    layers, remove what a crashed instance left and log the layer (a WARNING when it is not
    bubblewrap). SystemExit when not run as root; ValueError when max_sessions does not fit the
    uid block or default_policy is not in the policy file (or shares the host network unallowed)."""
    if settings.max_sessions > settings.uid_block_size - 1:
        raise ValueError(
            "max_sessions must be < uid_block_size (one uid per session plus a probe uid)"
        )
    if os.geteuid() != 0:
        raise SystemExit(
            "services.sandbox runs as root: it mounts size-capped workspaces, creates "
            "cgroups and runs every session as its own unprivileged uid"
        )
    # Own mount namespace (before any thread starts): session mounts never leak to the host.
    private_mounts = mounts.private_mount_namespace()
    policies = load_policies(settings)
    exec_mode = usable_exec_mode(settings.exec_mode)
    uids = UidPool(settings.uid_base, settings.uid_block_size)
    isolation, probes = detect(settings.isolation, uids.probe_uid)
    resources = setup_resources(settings, uids, isolation, private_mounts)
    manager = SessionManager(
        root=settings.workspace_root / f"block-{uids.block}",
        isolation=isolation,
        cgroups=resources.cgroups,
        uids=uids,
        policies=policies.policies,
        default_policy=settings.default_policy,
        default_limits=default_limits(settings),
        max_sessions=settings.max_sessions,
        session_ttl_s=settings.session_ttl_s,
        setup_timeout_s=settings.setup_timeout_s,
        max_timeout_s=settings.max_timeout_s,
        max_command_bytes=settings.max_command_bytes,
        max_concurrent_execs=settings.max_concurrent_execs,
        admission=resources.admission,
        exec_mode=exec_mode,
        egress=egress_doors(settings),
    )
    manager.clean_stale()
    details = {
        "isolation": isolation.layer,
        "exec_mode": exec_mode,
        "network_isolated": isolation.network_isolated,
        **resources.details(),
        "seccomp": isolation.seccomp_path is not None,
        "private_mount_namespace": private_mounts,
        "uid_block": [uids.first, uids.probe_uid],
        "probes": probes,
    }
    _report_isolation(manager, details)
    config = {
        **settings.public_dict(),
        "port": settings.listen_port,
        "isolation_active": isolation.layer,
    }
    log.info(
        "sandbox configured",
        extra={"host": settings.host, "port": settings.listen_port, "config": config},
    )
    return parts_over(
        manager,
        config,
        details,
        settings.ttl_sweep_interval_s,
        allow_network_policies=settings.allow_network_policies,
        warm_pool=WarmPool(
            manager,
            per_setup=settings.warm_pool_per_setup,
            max_sessions=settings.warm_pool_max_sessions,
            min_repeats=settings.warm_pool_min_repeats,
            reserve_sessions=settings.warm_pool_reserve_sessions,
        ),
        health=host_health(settings),
        health_interval_s=settings.health_interval_s,
    )


def load_policies(settings: SandboxSettings) -> PolicySet:
    """The policy file; ValueError when default_policy is not in it, or shares the host network
    while network policies are not allowed."""
    policies = PolicySet.load(settings.policy_file)
    if settings.default_policy not in policies.policies:
        raise ValueError(f"default_policy {settings.default_policy!r} is not in the policy file")
    if policies.policies[settings.default_policy].network and not settings.allow_network_policies:
        raise ValueError(
            f"default_policy {settings.default_policy!r} shares the host network: set "
            "SHELLRL_ALLOW_NETWORK_POLICIES=true to allow it"
        )
    return policies


def usable_exec_mode(exec_mode: str) -> str:
    """`exec_mode`, or per_command when the session runner's /usr/bin/python3 is missing."""
    if exec_mode == "session" and not os.access("/usr/bin/python3", os.X_OK):
        log.warning(
            "no /usr/bin/python3 for the session runner: falling back to exec_mode=per_command"
        )
        return "per_command"
    return exec_mode


def default_limits(settings: SandboxSettings) -> Limits:
    """A session's limits when its create request names none."""
    return Limits(
        timeout_s=settings.default_timeout_s,
        cpu_s=settings.cpu_s,
        memory_bytes=settings.memory_bytes,
        address_space_bytes=settings.address_space_bytes,
        pids=settings.pids,
        file_size_bytes=settings.file_size_bytes,
        workspace_bytes=settings.workspace_bytes,
        max_output_bytes=settings.max_output_bytes,
        nofile=settings.nofile,
        cpus=settings.cpus,
    )


def host_health(settings: SandboxSettings) -> HostHealth:
    """The host's health score (host/health.py) with the configured weights and bounds."""
    return HostHealth(
        settings.workspace_root,
        HealthWeights(
            settings.health_weight_load,
            settings.health_weight_memory,
            settings.health_weight_disk,
            settings.health_weight_latency,
        ),
        max_load_per_cpu=settings.health_max_load_per_cpu,
        max_latency_s=settings.health_max_exec_latency_s,
    )


def _report_isolation(manager: SessionManager, details: dict) -> None:
    """The isolation metrics, and a log line (WARNING below bubblewrap)."""
    isolation = manager.isolation
    metrics.ISOLATION.info(
        {
            "layer": isolation.layer,
            "cgroups": str(manager.cgroups.available).lower(),
            "network_isolated": str(isolation.network_isolated).lower(),
        }
    )
    metrics.init_series(isolation.layer)
    level = logging.INFO if isolation.layer == "bubblewrap" else logging.WARNING
    degraded = "" if isolation.layer == "bubblewrap" else " (DEGRADED: see README, Security)"
    log.log(level, f"sandbox isolation layer: {isolation.layer.upper()}{degraded}", extra=details)
