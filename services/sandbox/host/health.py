"""Terminal health score of this sandbox host: load, memory, disk and exec latency in one number.

Each part is a sub-score in [0, 1] (1 = healthy):

    load     1 - min(1, loadavg_1min / cpus / max_load_per_cpu)      (/proc/loadavg, os.cpu_count)
    memory   MemAvailable / MemTotal                                 (/proc/meminfo)
    disk     free / total of the file system holding workspace_root  (statvfs)
    latency  1 - min(1, p90 exec overhead / max_latency_s)           (last LATENCY_WINDOW execs)

    score = sum(weight_i * sub_i) / sum(weight_i)

Default weights load 0.3, memory 0.3, disk 0.2, latency 0.2. The real-terminal write-up this
comes from (issue 21) names the four parts and reports success rates below 30% whenever its
score fell under 0.45, but does not publish its weights: these defaults are ours, chosen so
that the two resources that stall commands outright (CPU, memory) weigh most. Exec overhead is
the time the sandbox added to a command: request arrival to result minus the command's own run
time (policy check, waits for the session and an exec slot, runner round trip), so a long
`sleep` in a task does not read as an unhealthy host. With no exec yet, latency scores 1.

Consumes nothing but the host's /proc and statvfs; produces `HealthSample` for /readyz
(`health`) and the gauges `shellrl_sandbox_health_*` (metrics.py). The rollout gateway reads
the score from /readyz and slows new groups below its threshold (services/rollout/health_gate.py).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from services.sandbox import metrics

LATENCY_WINDOW = 64
SAMPLE_TTL_S = 1.0  # a sample is reused this long (a scrape and a readiness probe share one)


@dataclass(frozen=True)
class HealthWeights:
    """Weights of the sub-scores (any non-negative numbers, at least one positive)."""

    load: float = 0.3
    memory: float = 0.3
    disk: float = 0.2
    latency: float = 0.2

    def __post_init__(self) -> None:
        values = (self.load, self.memory, self.disk, self.latency)
        if min(values) < 0 or sum(values) <= 0:
            raise ValueError("health weights must be >= 0 with a positive sum")


@dataclass(frozen=True)
class HealthSample:
    """One reading. load_per_cpu: 1-min load average / cpus; ratios in [0, 1]; exec_latency_s:
    p90 exec overhead over the last execs (s); score in [0, 1]."""

    load_per_cpu: float
    memory_available_ratio: float
    disk_free_ratio: float
    exec_latency_s: float
    score: float
    sub_scores: dict[str, float]

    def as_dict(self) -> dict:
        return {
            "score": round(self.score, 4),
            "load_per_cpu": round(self.load_per_cpu, 4),
            "memory_available_ratio": round(self.memory_available_ratio, 4),
            "disk_free_ratio": round(self.disk_free_ratio, 4),
            "exec_latency_s": round(self.exec_latency_s, 6),
            "sub_scores": {k: round(v, 4) for k, v in self.sub_scores.items()},
        }


def _clamp(x: float) -> float:
    return min(1.0, max(0.0, x))


def memory_available_ratio(meminfo: str = "/proc/meminfo") -> float:
    """MemAvailable / MemTotal of the host (1.0 when /proc/meminfo cannot be read)."""
    fields: dict[str, int] = {}
    try:
        for line in Path(meminfo).read_text().splitlines():
            name, _, rest = line.partition(":")
            fields[name] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return 1.0
    total = fields.get("MemTotal", 0)
    return _clamp(fields.get("MemAvailable", total) / total) if total else 1.0


def disk_free_ratio(path: Path) -> float:
    """Free / total bytes of the file system holding `path` (1.0 when it cannot be read)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 1.0
    return _clamp(st.f_bavail / st.f_blocks) if st.f_blocks else 1.0


def score_of(weights: HealthWeights, sub_scores: dict[str, float]) -> float:
    """Weighted mean of `sub_scores` (keys load, memory, disk, latency), in [0, 1]."""
    total = weights.load + weights.memory + weights.disk + weights.latency
    return _clamp(sum(getattr(weights, k) * v for k, v in sub_scores.items()) / total)


class HostHealth:
    """The health of the host this sandbox runs on (module doc)."""

    def __init__(
        self,
        workspace_root: Path,
        weights: HealthWeights | None = None,
        *,
        max_load_per_cpu: float = 2.0,
        max_latency_s: float = 1.0,
    ) -> None:
        if max_load_per_cpu <= 0 or max_latency_s <= 0:
            raise ValueError("max_load_per_cpu and max_latency_s must be > 0")
        self.workspace_root = Path(workspace_root)
        self.weights = weights or HealthWeights()
        self.max_load_per_cpu, self.max_latency_s = max_load_per_cpu, max_latency_s
        self.latencies_s: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._last: tuple[float, HealthSample] | None = None

    def observe_exec(self, overhead_s: float) -> None:
        """Record the overhead of one exec (s, >= 0: see module doc)."""
        self.latencies_s.append(max(0.0, overhead_s))

    def exec_latency_s(self) -> float:
        """p90 of the recorded exec overheads (s); 0 with none recorded."""
        if not self.latencies_s:
            return 0.0
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]

    def sample(self) -> HealthSample:
        """A reading, at most SAMPLE_TTL_S old; also sets the gauges."""
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < SAMPLE_TTL_S:
            return self._last[1]
        load = os.getloadavg()[0] / (os.cpu_count() or 1)
        memory = memory_available_ratio()
        disk = disk_free_ratio(self.workspace_root)
        latency = self.exec_latency_s()
        subs = {
            "load": _clamp(1 - load / self.max_load_per_cpu),
            "memory": memory,
            "disk": disk,
            "latency": _clamp(1 - latency / self.max_latency_s),
        }
        sample = HealthSample(load, memory, disk, latency, score_of(self.weights, subs), subs)
        self._last = (now, sample)
        _export(sample)
        return sample

    async def run(self, interval_s: float) -> None:
        """Sample every `interval_s` seconds (keeps the gauges current between probes)."""
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(interval_s)


def _export(sample: HealthSample) -> None:
    metrics.HEALTH_SCORE.set(sample.score)
    metrics.HEALTH_LOAD_PER_CPU.set(sample.load_per_cpu)
    metrics.HEALTH_MEMORY_AVAILABLE_RATIO.set(sample.memory_available_ratio)
    metrics.HEALTH_DISK_FREE_RATIO.set(sample.disk_free_ratio)
    metrics.HEALTH_EXEC_LATENCY_SECONDS.set(sample.exec_latency_s)
