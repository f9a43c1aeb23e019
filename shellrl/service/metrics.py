"""Prometheus helpers with the naming rules of DESIGN.md section 9.

Names: `shellrl_` prefix, base units (`_seconds`, `_bytes`), counters end in `_total`, low-cardinality
labels only (never an id). Each service defines its metrics in its own `metrics.py` with these
helpers so that a name is checked once, here.
"""

from __future__ import annotations

import re
import sys

from fastapi import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    Summary,
    generate_latest,
)
from prometheus_client import REGISTRY as DEFAULT_REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_NAME = re.compile(r"^shellrl_[a-z][a-z0-9_]*$")
_FORBIDDEN_LABELS = {"trajectory_id", "task_id", "group_id", "session_id", "request_id", "rid"}

# Latency buckets in seconds, from 1 ms to 5 min.
LATENCY_BUCKETS_S = (
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1,
    2,
    5,
    10,
    30,
    60,
    120,
    300,
)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 16, 32)


# Abbreviated or non-base units (promtool: "metric names should not contain abbreviated units").
_NON_BASE_UNITS = {
    "ms": "seconds",
    "msec": "seconds",
    "millis": "seconds",
    "milliseconds": "seconds",
    "us": "seconds",
    "microseconds": "seconds",
    "ns": "seconds",
    "nanoseconds": "seconds",
    "sec": "seconds",
    "secs": "seconds",
    "s": "seconds",
    "minutes": "seconds",
    "hours": "seconds",
    "kb": "bytes",
    "mb": "bytes",
    "gb": "bytes",
    "kib": "bytes",
    "mib": "bytes",
    "gib": "bytes",
    "percent": "ratio (0-1)",
    "pct": "ratio (0-1)",
}


def _check(name: str, labels: tuple[str, ...]) -> None:
    """Raise ValueError for a name that breaks DESIGN.md section 9 / Prometheus naming."""
    if not _NAME.match(name):
        raise ValueError(f"metric name {name!r} must match {_NAME.pattern}")
    for word in name.split("_")[1:]:
        if word in _NON_BASE_UNITS:
            raise ValueError(
                f"metric {name}: use base units ({_NON_BASE_UNITS[word]}), not '{word}'"
            )
    if name.endswith("_total") and "_total" in name[:-6]:
        raise ValueError(f"metric {name}: '_total' only once, at the end")
    bad_label = [label for label in labels if not re.fullmatch(r"[a-z][a-z0-9_]*", label)]
    if bad_label:
        raise ValueError(f"metric {name}: label names must be snake_case ({bad_label})")
    bad = _FORBIDDEN_LABELS.intersection(labels)
    if bad:
        raise ValueError(f"metric {name}: ids are not labels ({sorted(bad)})")


def counter(
    name: str, doc: str, labels: tuple[str, ...] = (), registry=DEFAULT_REGISTRY
) -> Counter:
    """A counter; `name` ends in `_total` (prometheus-client strips and re-adds it)."""
    _check(name, labels)
    if not name.endswith("_total"):
        raise ValueError(f"counter {name!r} must end in _total")
    return Counter(name, doc, labels, registry=registry)


def gauge(name: str, doc: str, labels: tuple[str, ...] = (), registry=DEFAULT_REGISTRY) -> Gauge:
    """A gauge; a gauge is no counter, so its name never ends in `_total`."""
    _check(name, labels)
    if name.endswith("_total"):
        raise ValueError(f"gauge {name!r} must not end in _total (that suffix marks counters)")
    return Gauge(name, doc, labels, registry=registry)


def summary(
    name: str, doc: str, labels: tuple[str, ...] = (), registry=DEFAULT_REGISTRY
) -> Summary:
    """A summary (`_count` and `_sum`, no quantiles): the mean of a value that may be negative,
    `rate(x_sum) / rate(x_count)`. A Histogram with negative buckets exposes no `_sum`
    (prometheus_client follows OpenMetrics there), so its mean cannot be queried."""
    _check(name, labels)
    return Summary(name, doc, labels, registry=registry)


def histogram(
    name: str,
    doc: str,
    labels: tuple[str, ...] = (),
    buckets=LATENCY_BUCKETS_S,
    registry=DEFAULT_REGISTRY,
) -> Histogram:
    """A histogram; the name ends in its base unit where it has one (`_seconds`, `_bytes`)."""
    _check(name, labels)
    if name.endswith("_total"):
        raise ValueError(f"histogram {name!r} must not end in _total (that suffix marks counters)")
    return Histogram(name, doc, labels, buckets=buckets, registry=registry)


def info(name: str, doc: str, registry=DEFAULT_REGISTRY) -> Info:
    _check(name, ())
    return Info(name, doc, registry=registry)


GPU_MEMORY_BYTES = "shellrl_gpu_memory_bytes"


class GpuMemoryCollector(Collector):
    """`shellrl_gpu_memory_bytes{device, kind}`: what torch's CUDA caching allocator holds in this
    process on each visible GPU (`device`: "cuda:<index>" as the process numbers it). kind:
    "allocated" (`torch.cuda.memory_allocated`), "reserved" (`memory_reserved`: allocated plus
    the allocator's cache), "peak_allocated" (`max_memory_allocated` since the process started).
    Bytes. Memory outside the allocator (the CUDA context, NCCL buffers, CUDA IPC mappings) is not
    counted: nvidia-smi shows it. No samples when the process never initialized CUDA (a CPU
    service), so a scrape never initializes it."""

    def collect(self):
        family = GaugeMetricFamily(
            GPU_MEMORY_BYTES,
            "Bytes torch's CUDA caching allocator holds in this process, by GPU and kind "
            "(allocated, reserved, peak_allocated).",
            labels=("device", "kind"),
        )
        torch = sys.modules.get("torch")  # never imported for this: a CPU service has no GPU
        if torch is not None and torch.cuda.is_initialized():
            for index in range(torch.cuda.device_count()):
                device = f"cuda:{index}"
                family.add_metric((device, "allocated"), torch.cuda.memory_allocated(index))
                family.add_metric((device, "reserved"), torch.cuda.memory_reserved(index))
                family.add_metric(
                    (device, "peak_allocated"), torch.cuda.max_memory_allocated(index)
                )
        yield family


_gpu_memory_registered: set[int] = set()


def register_gpu_memory(registry: CollectorRegistry = DEFAULT_REGISTRY) -> None:
    """Export `GpuMemoryCollector` on `registry` (once per registry; the services that may hold
    a GPU, engine and learner, call it when their metrics module loads)."""
    _check(GPU_MEMORY_BYTES, ("device", "kind"))
    if id(registry) not in _gpu_memory_registered:
        registry.register(GpuMemoryCollector())
        _gpu_memory_registered.add(id(registry))


def metrics_response(registry: CollectorRegistry = DEFAULT_REGISTRY) -> Response:
    """The `/metrics` response in Prometheus text format."""
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
