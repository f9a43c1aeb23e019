"""Sandbox executor: isolated per-episode workspaces, real command execution, limits, policy.

Consumes HTTP requests (DESIGN.md section 2); produces exec results. Guarantees: every command
runs in the best isolation layer detected at start-up (bubblewrap → unshare → process-group
fallback), under the session's limits, with a sanitized environment and no network unless the
session's policy allows it; nothing it starts outlives its command's timeout or its session.
"""
