"""What the control-plane benchmark reads of the running stack, at the edges of its window.

* `cpu_s(pid)`: user + system CPU seconds of one process (/proc/<pid>/stat, as psutil reads it).
* `redis_snapshot(url)`: INFO commandstats (calls and microseconds per command), INFO stats
  (commands processed, network bytes in and out), INFO cpu (the server's own CPU seconds), INFO
  memory (used_memory) and DBSIZE.
* `stream_lag(url)`: per consumer group of the three streams, entries pending (delivered, not
  acknowledged) and lag (not delivered yet).
* `prometheus(url)`: a service's /metrics as {'name{labels}': value}.
* `key_census(url)`: the per-episode keys that outlive their episode (idempotency keys, group
  accounting hashes): count, bytes and TTL of one; and the two trajectory streams' entries and
  bytes per entry (ttl_s -1: kept until trimmed).
`delta(before, after)` subtracts two snapshots key by key (nested dicts too).
"""

from __future__ import annotations

import httpx
import psutil
import redis

from shellrl.streams import keys

STREAM_GROUPS = (
    (keys.STREAM_TASKS, "rollout"),
    (keys.STREAM_EPISODES, "verifier"),
    (keys.STREAM_TRAJECTORIES, "learner"),
)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` (0.0 once it is gone)."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


def redis_snapshot(url: str) -> dict:
    client = redis.Redis.from_url(url)
    try:
        commands = {
            name.removeprefix("cmdstat_"): {"calls": v["calls"], "usec": v["usec"]}
            for name, v in client.info("commandstats").items()
        }
        stats, cpu, memory = client.info("stats"), client.info("cpu"), client.info("memory")
        keys = client.dbsize()
    finally:
        client.close()
    return {
        "commands": commands,
        "total_commands": stats["total_commands_processed"],
        "net_in_bytes": stats["total_net_input_bytes"],
        "net_out_bytes": stats["total_net_output_bytes"],
        "cpu_s": cpu["used_cpu_sys"] + cpu["used_cpu_user"],
        "used_memory_bytes": memory["used_memory"],
        "keys": keys,
    }


RETAINED = {"idempotency": "shellrl:idem:*", "group_accounting": "shellrl:rollout:group:*"}


def key_census(url: str) -> dict[str, dict[str, float]]:
    """Per kind of per-episode key that outlives its episode (RETAINED): how many exist, and the
    MEMORY USAGE and TTL of one of them (SCAN: run it outside a measured CPU window)."""
    client = redis.Redis.from_url(url)
    out = {}
    try:
        for kind, pattern in RETAINED.items():
            count, sample = 0, None
            for key in client.scan_iter(match=pattern, count=1000):
                count, sample = count + 1, sample or key
            out[kind] = {
                "keys": count,
                "bytes": float(client.memory_usage(sample, samples=0) or 0) if sample else 0.0,
                "ttl_s": float(client.ttl(sample)) if sample else 0.0,
            }
        for stream in (keys.STREAM_EPISODES, keys.STREAM_TRAJECTORIES):
            entries = int(client.xlen(stream))
            size = float(client.memory_usage(stream, samples=0) or 0) if entries else 0.0
            out[stream] = {"keys": entries, "bytes": size / max(entries, 1), "ttl_s": -1.0}
    finally:
        client.close()
    return out


def stream_lag(url: str) -> dict[str, dict[str, int]]:
    """{group: {"pending": n, "lag": n}} of the three streams' groups (missing ones skipped)."""
    client = redis.Redis.from_url(url)
    out = {}
    try:
        for stream, group in STREAM_GROUPS:
            try:
                groups = client.xinfo_groups(stream)
            except redis.ResponseError:
                continue
            for g in groups:
                if g["name"].decode() == group:
                    out[group] = {"pending": int(g["pending"]), "lag": int(g.get("lag") or 0)}
    finally:
        client.close()
    return out


def prometheus(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def delta(before, after):
    """after - before, key by key (nested dicts; keys only in `after` count from 0)."""
    if isinstance(after, dict):
        return {
            k: delta(before.get(k, 0) if isinstance(before, dict) else 0, v)
            for k, v in after.items()
        }
    return after - before
