"""Prometheus metrics of the sandbox executor (names per DESIGN.md section 9)."""

from shellrl.service.metrics import counter, gauge, histogram, info

EXEC_SECONDS = histogram(
    "shellrl_sandbox_exec_seconds", "Wall time of one exec, launch to result.", ("isolation",)
)
EXEC_QUEUE_SECONDS = histogram(
    "shellrl_sandbox_exec_queue_seconds",
    "Wait of one exec before it started: the session's earlier commands, then a free exec slot.",
    ("isolation",),
)
SESSIONS = gauge("shellrl_sandbox_sessions", "Live sandbox sessions.")
SESSIONS_CREATED = counter(
    "shellrl_sandbox_sessions_created_total", "Session creations by outcome.", ("outcome",)
)
SESSIONS_EXPIRED = counter(
    "shellrl_sandbox_sessions_expired_total", "Sessions removed by the idle TTL."
)
SETUP_SECONDS = histogram(
    "shellrl_sandbox_setup_seconds", "Session create: workspace, setup script, snapshot."
)
RESET_SECONDS = histogram(
    "shellrl_sandbox_reset_seconds", "Workspace reset to the post-setup snapshot."
)
TIMEOUTS = counter("shellrl_sandbox_timeouts_total", "Commands killed at their wall-clock timeout.")
KILLS = counter(
    "shellrl_sandbox_kills_total", "SIGKILLs sent to sandbox processes, by reason.", ("reason",)
)
POLICY_VERDICTS = counter(
    "shellrl_sandbox_policy_verdicts_total", "Policy verdicts.", ("verdict", "rule")
)
OUTPUT_TRUNCATED_BYTES = counter(
    "shellrl_sandbox_output_truncated_bytes_total", "Output bytes dropped by caps."
)
ADMISSION_REFUSALS = counter(
    "shellrl_sandbox_admission_refusals_total",
    "Sessions (what=session) and commands (what=exec) refused with 429, by the resource short.",
    ("what", "reason"),
)
HEADROOM_MEMORY_BYTES = gauge(
    "shellrl_sandbox_headroom_memory_bytes",
    "Memory free for sessions at the last admission check: the parent cgroup's and the host's.",
)
HEADROOM_PIDS = gauge(
    "shellrl_sandbox_headroom_pids",
    "Processes that can still start in sessions at the last admission check.",
)
CGROUP_LIMITS_ENFORCED = gauge(
    "shellrl_sandbox_cgroup_limits_enforced",
    "1: sessions run in cgroups under a parent bounding them all; 0: degraded (see /readyz).",
)
PROC_MASKED = gauge(
    "shellrl_sandbox_proc_masked",
    "1: host /proc information is masked in this layer (see /readyz proc_view); 0: not.",
)
EGRESS_REQUESTS = counter(
    "shellrl_sandbox_egress_requests_total",
    "Connections to the egress proxy by verdict (allow/deny/refused) and reason (rule, no_rule, "
    "rate_limit, byte_limit, internal_address, connection_limit, header_timeout, "
    "header_too_large, control_character, obs_fold, framing, malformed ...).",
    ("verdict", "reason"),
)
EGRESS_BYTES = counter(
    "shellrl_sandbox_egress_bytes_total",
    "Bytes through the egress proxy: sent (session to upstream), received (upstream to session).",
    ("direction",),
)
ISOLATION = info(
    "shellrl_sandbox_isolation", "Isolation layer this instance runs (probed at start-up)."
)


def init_series(layer: str) -> None:
    """Create the labelled series known at start-up (value 0) for this instance's isolation `layer`,
    so dashboards show 0 instead of "no data" before the first exec / session."""
    EXEC_SECONDS.labels(layer)
    EXEC_QUEUE_SECONDS.labels(layer)
    for outcome in ("ok", "setup_failed", "error"):  # as sessions.SessionManager.create counts them
        SESSIONS_CREATED.labels(outcome)
    EGRESS_REQUESTS.labels("allow", "rule")
    EGRESS_REQUESTS.labels("deny", "no_rule")
    for direction in ("sent", "received"):
        EGRESS_BYTES.labels(direction)
    for what in ("session", "exec"):  # as admission.Admission refuses
        for reason in ("sessions", "memory", "pids") if what == "session" else ("memory", "pids"):
            ADMISSION_REFUSALS.labels(what, reason)


WARM_POOL_SESSIONS = gauge(
    "shellrl_sandbox_warm_pool_sessions",
    "Ready sessions waiting in the warm pool (sessions/warm_pool.py).",
)
WARM_POOL_REQUESTS = counter(
    "shellrl_sandbox_warm_pool_requests_total",
    "Session creates by whether the warm pool had a ready session of the same setup (hit, miss).",
    ("result",),
)
WARM_POOL_FILLS = counter(
    "shellrl_sandbox_warm_pool_fills_total", "Sessions created and set up ahead of demand."
)
WARM_POOL_EVICTIONS = counter(
    "shellrl_sandbox_warm_pool_evictions_total",
    "Warm sessions deleted to make room for a create at the session cap.",
)


HEALTH_SCORE = gauge(
    "shellrl_sandbox_health_score",
    "Terminal health score in [0, 1] (services/sandbox/host/health.py: load, memory, disk, latency).",
)
HEALTH_LOAD_PER_CPU = gauge(
    "shellrl_sandbox_health_load_per_cpu", "Host 1-minute load average divided by the CPU count."
)
HEALTH_MEMORY_AVAILABLE_RATIO = gauge(
    "shellrl_sandbox_health_memory_available_ratio", "Host MemAvailable / MemTotal."
)
HEALTH_DISK_FREE_RATIO = gauge(
    "shellrl_sandbox_health_disk_free_ratio",
    "Free / total bytes of the file system holding the workspace root.",
)
HEALTH_EXEC_LATENCY_SECONDS = gauge(
    "shellrl_sandbox_health_exec_latency_seconds",
    "p90 overhead the sandbox added to its last 64 execs (arrival to result minus run time).",
)
