"""One measured point of the control-plane benchmark: a started Stack, warmed up, then a window.

Warm-up ends when the learner has taken `warm_steps` steps (trajectories went through every
stage; deadline `warm_deadline_s`). Then, over `window_s` seconds: CPU seconds of every process
(before/after), Redis INFO (commands, bytes, CPU) before/after, the gateways' and learner's
counters before/after, and the three consumer groups' pending entries and lag sampled every
`sample_s` seconds. Costs are per turn and per episode finished by the gateways in the window.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from benchmarks.control_plane_probe import (
    cpu_s,
    delta,
    key_census,
    prometheus,
    redis_snapshot,
    stream_lag,
)
from benchmarks.control_plane_stack import Stack

ROLES = ("gateways", "verifier", "learner", "redis", "fakes")
CALLS = ("generate", "exec", "session_create", "episode")  # the gateways' latency histograms


def per_unit_ms(cores: dict[str, float], wall_s: float, units: float) -> dict[str, float]:
    """Per role, CPU ms per unit (turn, episode) over a window of `wall_s` seconds in which the
    role used `cores` cores: NaN (not measured) when no unit finished in the window (a quick
    run's 3 s on a busy machine can end before one does), not the window's whole CPU time."""
    return {r: 1000 * cores.get(r, 0.0) * wall_s / units if units > 0 else math.nan for r in ROLES}


def role(name: str) -> str:
    if name.startswith("gateway"):
        return "gateways"
    if name.startswith("redis"):  # the control Redis and the stream shards, together
        return "redis"
    return {"engines": "fakes", "sandbox": "fakes"}.get(name, name)


@dataclass
class Point:
    engines: int
    gateways: int
    window_s: float
    turns_per_s: float
    episodes_per_s: float
    trained_per_s: float
    steps: int
    cpu_cores: dict[str, float]  # role -> cores used over the window
    ms_per_turn: dict[str, float]  # role -> CPU ms per turn
    ms_per_episode: dict[str, float]  # role -> CPU ms per episode
    redis_calls_per_episode: dict[str, float]
    redis_usec_per_call: dict[str, float]
    redis_in_bytes_per_episode: float
    redis_out_bytes_per_episode: float
    admission_wait_s_per_group: dict[str, float]
    groups_admitted_per_s: float
    lag: dict[str, dict[str, float]]  # group -> {pending_mean, pending_max, lag_mean, lag_max}
    staleness: dict[int, int]
    dropped: dict[str, float]
    loadavg: tuple[float, float, float]
    machine_cores_used: float = 0.0
    call_ms: dict[str, float] = field(default_factory=dict)  # mean as the gateways saw it
    redis_memory_bytes_per_episode: float = 0.0  # used_memory growth over the window
    redis_keys_per_episode: float = 0.0  # DBSIZE growth over the window
    # kind -> keys per episode, bytes per key, TTL s: the keys an episode leaves behind
    retained: dict[str, dict[str, float]] = field(default_factory=dict)
    stream_shards: int = 0  # Redis instances holding the training streams beside the control one
    # each Redis process ("redis": the control one, "redis-shard-k") -> its CPU ms per episode
    redis_instance_ms_per_episode: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, body: dict) -> Point:
        known = {f for f in cls.__dataclass_fields__}
        point = cls(**{k: v for k, v in body.items() if k in known})
        point.staleness = {int(k): v for k, v in point.staleness.items()}
        point.loadavg = tuple(point.loadavg)
        return point


def _learner(stack: Stack) -> dict:
    try:
        return json.loads(stack.learner_stats.read_text())
    except (OSError, ValueError):
        return {"version": -1, "trained": 0, "dropped": {}, "staleness": {}}


def _gateways(stack: Stack) -> dict[str, float]:
    total: Counter[str] = Counter()
    for url in stack.gateway_urls:
        for key, value in prometheus(url).items():
            if key.startswith(("shellrl_rollout_turns_total", "shellrl_rollout_groups_admitted")):
                total[key.split("{")[0]] += value
            elif re.fullmatch(rf"shellrl_rollout_({'|'.join(CALLS)})_seconds_(sum|count)", key):
                total[key] += value
            elif key.startswith("shellrl_rollout_episodes_total{"):
                total["episodes"] += value
            elif m := re.fullmatch(
                r'shellrl_rollout_admission_wait_seconds_sum\{reason="(\w+)"\}', key
            ):
                total[f"wait:{m.group(1)}"] += value
    return dict(total)


def wait_warm(stack: Stack, steps: int, deadline_s: float) -> None:
    """Until the learner has taken `steps` steps; RuntimeError past `deadline_s` or when a
    process died."""
    deadline = time.monotonic() + deadline_s
    while _learner(stack).get("version", -1) < steps:
        stack.check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"learner not at step {steps} within {deadline_s} s: {_learner(stack)}"
            )
        time.sleep(0.2)  # poll period of the condition above


def _summed(parts: list[dict]) -> dict:
    """Nested dicts of numbers added key by key (the Redis instances' figures, together)."""
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict):
                out[key] = _summed([out.get(key, {}), value])
            else:
                out[key] = out.get(key, 0) + value
    return out


def _census(urls: list[str]) -> dict[str, dict[str, float]]:
    """`key_census` of every Redis instance: keys summed, a key's bytes and TTL from the first
    instance that holds one."""
    out: dict[str, dict[str, float]] = {}
    for census in map(key_census, urls):
        for kind, c in census.items():
            have = out.setdefault(kind, {"keys": 0, "bytes": 0.0, "ttl_s": 0.0})
            if not have["keys"] and c["keys"]:
                have["bytes"], have["ttl_s"] = c["bytes"], c["ttl_s"]
            have["keys"] += c["keys"]
    return out


def measure(stack: Stack, window_s: float, sample_s: float = 0.5) -> Point:
    urls = stack.redis_urls  # the control Redis, then the stream shards
    pids = stack.pids()
    census0 = _census(urls)  # SCANs: outside the CPU window
    cpu0 = {n: cpu_s(p) for n, p in pids.items()}
    redis0, gw0, learner0 = [redis_snapshot(u) for u in urls], _gateways(stack), _learner(stack)
    start = time.monotonic()
    samples: list[dict] = []
    while (now := time.monotonic()) < start + window_s:
        samples.append(_summed([stream_lag(u) for u in urls]))
        time.sleep(min(sample_s, max(0.0, start + window_s - now)))  # the sampling period
    wall = time.monotonic() - start
    cpu1 = {n: cpu_s(p) for n, p in pids.items()}
    redis1, gw1, learner1 = [redis_snapshot(u) for u in urls], _gateways(stack), _learner(stack)
    census1 = _census(urls)
    stack.check_alive()

    gw = delta(gw0, gw1)
    rd = _summed([delta(a, b) for a, b in zip(redis0, redis1, strict=True)])
    turns, episodes = gw.get("shellrl_rollout_turns_total", 0.0), gw.get("episodes", 0.0)
    groups = gw.get("shellrl_rollout_groups_admitted_total", 0.0)
    cores: Counter[str] = Counter()
    for name in pids:
        cores[role(name)] += (cpu1[name] - cpu0[name]) / wall
    own = {  # on each instance
        c: n * len(urls)
        for c, n in {
            "xinfo|groups": 3 * len(samples), "info": 4, "dbsize": 1, "hello": len(samples) + 1
        }.items()
    }  # fmt: skip
    for command, n in own.items():  # this harness's own commands (stream_lag, redis_snapshot)
        if command in rd["commands"]:
            rd["commands"][command]["calls"] = max(0, rd["commands"][command]["calls"] - n)
    calls = {c: v["calls"] for c, v in rd["commands"].items() if v["calls"] > 0}
    staleness = Counter({int(k): v for k, v in learner1.get("staleness", {}).items()})
    staleness.subtract({int(k): v for k, v in learner0.get("staleness", {}).items()})
    lag = {}
    for group in ("rollout", "verifier", "learner"):
        rows = [s[group] for s in samples if group in s]
        if rows:
            lag[group] = {}
            for k in ("pending", "lag"):
                values = [r[k] for r in rows]
                lag[group][f"{k}_mean"] = sum(values) / len(values)
                lag[group][f"{k}_max"] = float(max(values))
    return Point(
        engines=stack.config.engines,
        gateways=stack.config.gateways,
        window_s=wall,
        turns_per_s=turns / wall,
        episodes_per_s=episodes / wall,
        trained_per_s=(learner1["trained"] - learner0["trained"]) / wall,
        steps=learner1["version"] - learner0["version"],
        cpu_cores=dict(cores),
        ms_per_turn=per_unit_ms(cores, wall, turns),
        ms_per_episode=per_unit_ms(cores, wall, episodes),
        redis_calls_per_episode={c: n / max(episodes, 1) for c, n in sorted(calls.items())},
        redis_usec_per_call={c: rd["commands"][c]["usec"] / n for c, n in calls.items() if n},
        redis_in_bytes_per_episode=rd["net_in_bytes"] / max(episodes, 1),
        redis_out_bytes_per_episode=rd["net_out_bytes"] / max(episodes, 1),
        admission_wait_s_per_group={
            k.removeprefix("wait:"): v / max(groups, 1)
            for k, v in gw.items()
            if k.startswith("wait:")
        },
        groups_admitted_per_s=groups / wall,
        lag=lag,
        staleness={k: v for k, v in sorted(staleness.items()) if v > 0},
        dropped={
            k: v - learner0.get("dropped", {}).get(k, 0.0)
            for k, v in learner1.get("dropped", {}).items()
            if v - learner0.get("dropped", {}).get(k, 0.0) > 0
        },
        loadavg=os.getloadavg(),
        machine_cores_used=sum(cores.values()),
        redis_memory_bytes_per_episode=rd["used_memory_bytes"] / max(episodes, 1),
        redis_keys_per_episode=rd["keys"] / max(episodes, 1),
        retained={
            kind: {
                "keys_per_episode": (c["keys"] - census0[kind]["keys"]) / max(episodes, 1),
                "bytes_per_key": c["bytes"],
                "ttl_s": c["ttl_s"],
            }
            for kind, c in census1.items()
        },
        stream_shards=stack.config.stream_shards,
        redis_instance_ms_per_episode={
            name: 1000 * (cpu1[name] - cpu0[name]) / episodes if episodes > 0 else math.nan
            for name in pids
            if name.startswith("redis")
        },
        call_ms={
            c: 1000
            * gw.get(f"shellrl_rollout_{c}_seconds_sum", 0.0)
            / max(gw.get(f"shellrl_rollout_{c}_seconds_count", 0.0), 1)
            for c in CALLS
        },
    )
