"""Prometheus metrics of the engine (names per DESIGN.md section 9; SGLang's own `sglang:*` names are
not reproduced, see docs/sglang.md)."""

from __future__ import annotations

from shellrl.service.metrics import counter, gauge, histogram, register_gpu_memory

register_gpu_memory()  # shellrl_gpu_memory_bytes: the engine's model and KV on a GPU

REQUEST_SECONDS = histogram(
    "shellrl_engine_request_seconds",
    "End-to-end /generate latency per request, by finish reason.",
    ("finish_reason",),
)
REQUESTS = counter(
    "shellrl_engine_requests_total", "Finished requests, by finish reason.", ("finish_reason",)
)
CLIENT_DISCONNECTS = counter(
    "shellrl_engine_client_disconnects_total",
    "Requests aborted because their client closed the connection before the answer.",
)
PROMPT_TOKENS = counter("shellrl_engine_prompt_tokens_total", "Prompt tokens of admitted requests.")
CACHED_TOKENS = counter(
    "shellrl_engine_cached_tokens_total", "Prompt tokens served from the prefix cache."
)
GENERATION_TOKENS = counter("shellrl_engine_generation_tokens_total", "Generated (sampled) tokens.")
BATCH_SIZE = gauge(
    "shellrl_engine_batch_size", "Requests decoded together in the latest decode step."
)
RUNNING = gauge("shellrl_engine_running_requests", "Requests in the running batch.")
WAITING = gauge(
    "shellrl_engine_waiting_requests", "Requests queued (including those held by a pause)."
)
PREFIX_CACHE_BYTES = gauge(
    "shellrl_engine_prefix_cache_bytes", "Bytes of KV held by the prefix cache."
)
KV_BYTES = gauge(
    "shellrl_engine_kv_bytes",
    "Bytes of KV buffers held besides the prefix cache: the running batch's "
    "and the freed ones kept for reuse; 0 when idle.",
)
DECODE_STEP_SECONDS = histogram(
    "shellrl_engine_decode_step_seconds", "Wall time of one batched decode step."
)
DECODE_STEPS = counter(
    "shellrl_engine_decode_steps_total",
    "Decode steps, by how they ran: graph (a CUDA graph replay over the static KV arena), "
    "static (the same step without graphs) or eager (transformers' forward over the batch's own KV).",
    ("mode",),
)
DECODE_GRAPH_BYTES = gauge(
    "shellrl_engine_decode_graph_bytes",
    "Bytes of the decode graphs' static KV arena (0: no graphs).",
)
WEIGHT_UPDATE_GROUPS = gauge(
    "shellrl_engine_weight_update_groups",
    "Weight-update process groups live on this engine (init_weights_update_group; 0 once the "
    "learner destroyed its group).",
)
PREFILL_SECONDS = histogram("shellrl_engine_prefill_seconds", "Wall time of one batched prefill.")
STEP_FAILURES = counter(
    "shellrl_engine_step_failures_total",
    "Prefill or decode forwards that raised, by stage and exception class (their requests end "
    "with an engine error; OutOfMemoryError also empties the prefix cache).",
    ("stage", "error"),
)
WEIGHT_UPDATE_SECONDS = histogram(
    "shellrl_engine_weight_update_seconds",
    "Weight update time from request to live weights, by source.",
    ("source",),
)
WEIGHT_UPDATE_PHASE_SECONDS = histogram(
    "shellrl_engine_weight_update_phase_seconds",
    "Parts of a weight update: stage (validate + copy into the spare arena, worker thread), stage_hop (the "
    "handler's wait for that thread beyond the work), commit (swap on the scheduler thread), commit_hop (the "
    "wait for the scheduler beyond the swap).",
    ("phase",),
    buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3),
)
