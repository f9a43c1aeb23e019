"""Prometheus metrics of the stream layer (every service that produces or consumes exports them)."""

from __future__ import annotations

from shellrl.service import metrics

STREAM_LENGTH = metrics.gauge("shellrl_stream_length", "Entries in a stream (XLEN).", ("stream",))
STREAM_PENDING = metrics.gauge(
    "shellrl_stream_pending",
    "Entries delivered to a group but not acknowledged.",
    ("stream", "group"),
)
STREAM_LAG = metrics.gauge(
    "shellrl_stream_lag", "Entries not yet delivered to a group.", ("stream", "group")
)
RECLAIMED = metrics.counter(
    "shellrl_stream_reclaimed_total", "Entries re-claimed from idle consumers.", ("stream", "group")
)
DEAD_LETTERS = metrics.counter(
    "shellrl_stream_dead_letters_total", "Entries moved to shellrl:dead.", ("stream", "group")
)
DUPLICATES = metrics.counter(
    "shellrl_stream_duplicates_total",
    "Adds skipped because their idempotency key existed.",
    ("stream",),
)
TRIMMED = metrics.counter(
    "shellrl_stream_trimmed_total", "Acknowledged entries removed by trimming.", ("stream",)
)
LOST = metrics.counter(
    "shellrl_stream_lost_total",
    "Pending entries trimmed away before they were handled (their references acknowledged).",
    ("stream", "group"),
)
