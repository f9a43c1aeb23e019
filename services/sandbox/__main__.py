"""`python -m services.sandbox [--host H] [--port P]`: probe isolation, then serve the API."""

from __future__ import annotations

import argparse
import logging
import os

from services.sandbox import metrics, mounts
from services.sandbox.app import build_app
from services.sandbox.cgroups import CgroupSupport
from services.sandbox.isolation import detect
from services.sandbox.limits import Limits
from services.sandbox.policy import PolicySet
from services.sandbox.sessions import SessionManager, UidPool
from services.sandbox.settings import DEFAULT_PORT, SandboxSettings
from shellrl.service.app import serve
from shellrl.service.logging import setup_logging

log = logging.getLogger("services.sandbox")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m services.sandbox", description=__doc__)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    settings = SandboxSettings.from_env_or_exit(**overrides)
    port = settings.port or DEFAULT_PORT
    setup_logging("sandbox", settings.log_level)
    if settings.max_sessions > settings.uid_block_size - 1:
        raise ValueError("max_sessions must be < uid_block_size (one uid per session plus a probe uid)")
    if os.geteuid() != 0:
        raise SystemExit("services.sandbox runs as root: it mounts size-capped workspaces, creates cgroups and "
                         "runs every session as its own unprivileged uid")
    # Own mount namespace (before any thread starts): session mounts never leak to the host.
    private_mounts = mounts.private_mount_namespace()
    policies = PolicySet.load(settings.policy_file)
    if settings.default_policy not in policies.policies:
        raise ValueError(f"default_policy {settings.default_policy!r} is not in the policy file")
    exec_mode = settings.exec_mode
    if exec_mode == "session" and not os.access("/usr/bin/python3", os.X_OK):
        log.warning("no /usr/bin/python3 for the session runner: falling back to exec_mode=per_command")
        exec_mode = "per_command"
    uids = UidPool(settings.uid_base, settings.uid_block_size)
    isolation, probes = detect(settings.isolation, uids.probe_uid)
    cgroups = CgroupSupport(settings.cgroup_root)
    root = settings.workspace_root / f"block-{uids.block}"
    defaults = Limits(timeout_s=settings.default_timeout_s, cpu_s=settings.cpu_s, memory_bytes=settings.memory_bytes,
                      address_space_bytes=settings.address_space_bytes, pids=settings.pids,
                      file_size_bytes=settings.file_size_bytes, workspace_bytes=settings.workspace_bytes,
                      max_output_bytes=settings.max_output_bytes, nofile=settings.nofile)
    manager = SessionManager(
        root=root, isolation=isolation, cgroups=cgroups, uids=uids, policies=policies.policies,
        default_policy=settings.default_policy, default_limits=defaults, max_sessions=settings.max_sessions,
        session_ttl_s=settings.session_ttl_s, setup_timeout_s=settings.setup_timeout_s,
        max_timeout_s=settings.max_timeout_s, max_command_bytes=settings.max_command_bytes,
        max_concurrent_execs=settings.max_concurrent_execs, exec_mode=exec_mode,
    )
    manager.clean_stale()
    details = {"isolation": isolation.layer, "exec_mode": exec_mode, "network_isolated": isolation.network_isolated,
               "cgroups": cgroups.available, "seccomp": isolation.seccomp_path is not None,
               "private_mount_namespace": private_mounts,
               "uid_block": [uids.first, uids.probe_uid], "probes": probes}
    metrics.ISOLATION.info({"layer": isolation.layer, "cgroups": str(cgroups.available).lower(),
                            "network_isolated": str(isolation.network_isolated).lower()})
    metrics.init_series(isolation.layer)
    level = logging.INFO if isolation.layer == "bubblewrap" else logging.WARNING
    log.log(level, f"sandbox isolation layer: {isolation.layer.upper()}"
            + ("" if isolation.layer == "bubblewrap" else " (DEGRADED: see README, Security)"), extra=details)
    config = {**settings.public_dict(), "port": port, "isolation_active": isolation.layer}
    app = build_app(manager, config, details, settings.ttl_sweep_interval_s)
    log.info("starting sandbox", extra={"host": settings.host, "port": port, "config": config})
    serve(app, settings.host, port, settings.log_level, settings.shutdown_grace_s)


if __name__ == "__main__":
    main()
