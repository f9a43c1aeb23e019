"""Collect and render the state of a running stack (used by `shellrl status` and `shellrl run`).

`collect(info)` reads each service's /readyz and /v1/status (with the stack's token, from the file
the pid file names: `api_token_file`), Redis stream lengths and backlogs, the entries each group
lost to trimming (pending entries trimmed away before they were handled: `lost_key`, counted by
every stream consumer, kept across restarts), the staleness histogram from the learner's
/metrics and the engine's generated-token counter, and the processes of the pid file that have
exited (`exited`: {name: {"class", "cause"}}, the cause being the last error line of the log the
pid file names: cli/stack_failure.py); it never raises (a service that does not answer shows as
down). `down_parts(snapshot)` names what is down; `down_causes(snapshot)` adds why;
`render(snapshot)` returns a rich renderable.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families
from rich.markup import escape
from rich.table import Table

from cli.stack_config import api_headers
from cli.stack_failure import failure_class, last_error_line
from shellrl import streams
from shellrl.streams.keys import lost_key

STREAM_GROUPS = (
    (streams.STREAM_TASKS, streams.GROUP_ROLLOUT),
    (streams.STREAM_EPISODES, streams.GROUP_VERIFIER),
    (streams.STREAM_TRAJECTORIES, streams.GROUP_LEARNER),
    (streams.STREAM_DEAD, None),
)

GENERATION_TOKEN_COUNTERS = ("shellrl_engine_generation_tokens", "sglang:generation_tokens")


def _get(url: str, timeout_s: float = 2.0, headers: dict | None = None) -> dict | None:
    try:
        r = httpx.get(url, timeout=timeout_s, headers=headers)
        return (
            r.json()
            if r.headers.get("content-type", "").startswith("application/json")
            else {"status": r.status_code}
        )
    except (httpx.HTTPError, ValueError):
        return None


def histogram_buckets(metrics_text: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts {le: count} of histogram `name` (summed over label sets)."""
    out: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                le = float(sample.labels["le"])
                out[le] = out.get(le, 0.0) + sample.value
    return dict(sorted(out.items()))


def counter_total(metrics_text: str, names: tuple[str, ...]) -> float | None:
    """Sum of the counter samples `<name>_total` (every label set) of the first of `names` that
    the text has; None when it has none of them."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            for name in names:
                if sample.name in (name, f"{name}_total"):
                    found[name] = found.get(name, 0.0) + sample.value
    return next((found[n] for n in names if n in found), None)


def quantile_from_buckets(buckets: dict[float, float], q: float) -> float | None:
    """Upper bound of the bucket holding quantile q (Prometheus-style, no interpolation)."""
    if not buckets:
        return None
    total = max(buckets.values())
    if total <= 0:
        return None
    for le, count in buckets.items():
        if count >= q * total:
            return le
    return None


def stream_stats(redis_url: str) -> dict[str, dict]:
    """{stream: {"length", "pending", "lag" (of the stream's pipeline group), "lost": {group:
    entries trimmed away before that group handled them}}}, plus "_policy_version", or "_error"
    when Redis did not answer."""
    out: dict[str, dict] = {}
    try:
        r = redis.Redis.from_url(redis_url, socket_timeout=2)
        for stream, group in STREAM_GROUPS:
            row = {"length": int(r.xlen(stream)), "pending": None, "lag": None}
            lost = sorted(r.hgetall(lost_key(stream)).items())
            row["lost"] = {g.decode(): int(n) for g, n in lost}
            if group:
                try:
                    for g in r.xinfo_groups(stream):
                        if g["name"].decode() == group:
                            row["pending"], row["lag"] = int(g["pending"]), g.get("lag")
                except redis.ResponseError:
                    pass
            out[stream] = row
        version = r.get(streams.POLICY_VERSION_KEY)
        out["_policy_version"] = int(version) if version is not None else None
        r.close()
    except redis.RedisError as exc:
        out["_error"] = str(exc)
    return out


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not yet reaped by its launcher, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: kill(0) said it exists


def exited_processes(info: dict) -> dict[str, dict]:
    """{name: {"class", "cause"}} of the pid file's processes that no longer run; cause: the last
    error line of the log the pid file names (None without one); class: its failure class
    (cli/stack_failure.py; the exit status belongs to the launcher, so signals are not told)."""
    out = {}
    for name, pid in (info.get("processes") or {}).items():
        if process_alive(int(pid)):
            continue
        log = (info.get("logs") or {}).get(name)
        cause = last_error_line(Path(log)) if log else None
        out[name] = {"class": failure_class(None, cause), "cause": cause}
    return out


def collect(info: dict) -> dict:
    urls = info.get("urls", {})
    snap: dict = {"time": time.time(), "ready": {}, "streams": stream_stats(info["redis_url"])}
    snap["exited"] = exited_processes(info)
    for name, url in urls.items():
        ready = _get(f"{url}/readyz")
        snap["ready"][name] = bool(ready and ready.get("ready"))
    token_file = info.get("api_token_file")
    headers = api_headers(environ={"SHELLRL_API_TOKEN_FILE": token_file} if token_file else None)
    learner, rollout = urls.get("learner"), urls.get("rollout")
    snap["learner"] = _get(f"{learner}/v1/status", headers=headers) if learner else None
    snap["rollout"] = _get(f"{rollout}/v1/status", headers=headers) if rollout else None
    snap["staleness"] = {}
    if "learner" in urls:
        try:
            text = httpx.get(f"{urls['learner']}/metrics", timeout=2).text
            buckets = histogram_buckets(text, "shellrl_trajectory_staleness")
            snap["staleness"] = {q: quantile_from_buckets(buckets, q) for q in (0.5, 0.9, 0.99)}
        except httpx.HTTPError:
            pass
    if "engine" in urls:  # what rollouts generated (shellrl's engine or SGLang), for tokens/s
        try:
            text = httpx.get(f"{urls['engine']}/metrics", timeout=2).text
            snap["engine_generation_tokens"] = counter_total(text, GENERATION_TOKEN_COUNTERS)
        except httpx.HTTPError:
            pass
    return snap


def down_parts(snap: dict) -> list[str]:
    """What is down in a `collect` snapshot: services not ready and Redis when it did not answer
    (e.g. ["engine", "redis"]); [] when everything is up."""
    down = [name for name, ok in snap["ready"].items() if not ok]
    down += [name for name in snap.get("exited", {}) if name not in down]
    if "_error" in snap["streams"] and "redis" not in down:
        down.append("redis")
    return down


def down_causes(snap: dict) -> list[str]:
    """`down_parts` with the cause of each process that exited, e.g.
    ["learner (exited: oom: torch.OutOfMemoryError: CUDA out of memory)", "engine"]."""
    exited = snap.get("exited", {})
    out = []
    for name in down_parts(snap):
        why = exited.get(name)
        if why is None:
            out.append(name)
        else:
            cause = f": {why['cause']}" if why["cause"] else ""
            out.append(f"{name} (exited: {why['class']}{cause})")
    return out


def shown(value, fmt: str = "") -> str:
    """A table cell: '-' for a value not known (None, NaN; never 'None' or 'nan'), else
    `format(value, fmt)`."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, fmt)


def render(snap: dict) -> Table:
    table = Table(title="shellrl status", show_header=False, expand=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    table.add_row(
        "services",
        "  ".join(
            f"{n}:{'[green]ready' if ok else '[red]down'}[/]" for n, ok in snap["ready"].items()
        ),
    )
    for name, why in snap.get("exited", {}).items():
        cause = escape(why["cause"] or "log empty")  # a log line may hold [brackets]
        table.add_row(f"{name} exited", f"[red]{escape(why['class'])}[/]: {cause}")
    st = snap["streams"]
    table.add_row("policy version (redis)", shown(st.get("_policy_version")))
    learner = snap.get("learner") or {}
    last = learner.get("last_step") or {}
    if learner:
        table.add_row(
            "learner",
            f"step {shown(learner.get('step'))}  lr {shown(learner.get('lr'))}  paused "
            f"{shown(learner.get('paused'))}  checkpointed {shown(learner.get('checkpointed_step'))}",
        )
        table.add_row(
            "last step",
            f"reward {shown(last.get('reward_mean'), '.3f')}  success "
            f"{shown(last.get('success_rate'), '.3f')}  loss {shown(last.get('loss'), '.4g')}  "
            f"{shown(last.get('seconds'), '.1f')} s  tokens/s "
            f"{shown(last.get('tokens_per_second'), '.0f')}",
        )
        table.add_row(
            "throughput",
            f"{learner.get('trajectories_per_second', 0) * 60:.1f} trajectories/min trained",
        )
    rollout = snap.get("rollout") or {}
    if rollout:
        adm = rollout.get("admission", {})
        table.add_row(
            "rollout",
            f"in flight {shown(rollout.get('episodes_in_flight'))}  admitted groups "
            f"{shown(adm.get('groups_admitted'))}/{shown(adm.get('bound'))}  published "
            f"{shown(rollout.get('trajectories_published'))}",
        )
    s = snap.get("staleness") or {}
    table.add_row("staleness p50/p90/p99", " / ".join(shown(s.get(q)) for q in (0.5, 0.9, 0.99)))
    for stream, row in st.items():
        if not stream.startswith("_"):
            lost = ", ".join(f"{g} {n}" for g, n in row.get("lost", {}).items() if n)
            table.add_row(
                stream,
                f"length {row['length']}  pending {shown(row['pending'])}  lag {shown(row['lag'])}"
                + (f"  [red]lost to trimming: {lost}[/]" if lost else ""),
            )
    if "_error" in st:
        table.add_row("redis", f"[red]{st['_error']}")
    return table
