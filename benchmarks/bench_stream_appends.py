"""Redis server CPU per stream append: payload through Lua vs payload outside Lua (issue 35).

Each variant appends `--n` entries of one payload size (random bytes: 4 KB, the harness's
trajectories, and 34 KB, a long one) with routing fields and an idempotency key, one append in
flight at a time, against a fresh real redis-server (AOF everysec, tests/helpers/redis_server.py).
Around each variant's window the server's INFO is read: CPU (`used_cpu_sys` + `used_cpu_user`,
the whole process, and the main thread's), `total_commands_processed`, `total_reads_processed`
(requests read: round trips) and commandstats (usec of command execution: EVALSHA's includes the
commands its script calls, which Redis 7 also counts under their own names, in other_usec).
Variants run interleaved for `--rounds` rounds; the median per append is reported, and each
variant's ratio to the Lua variant of its kind.

add (the gateway's publish, `StreamProducer.add`):
  lua            the Lua script (GET key; XADD; SET key id EX ttl): 1 round trip
  multi          the same guarantees with the payload outside Lua (`WatchedProducer` here):
                 WATCH key + GET key; MULTI, XADD, SET key ? EX ttl, EXEC; SET key id XX KEEPTTL:
                 3 round trips (a concurrent add of the key aborts the EXEC; MULTI/EXEC is
                 atomic in the AOF; the id is recorded after EXEC, as `add_many` does)
  multi-norecord the same without recording the entry id (a duplicate then answers id ""):
                 2 round trips
  multi-std      `add_many` of one entry (redis-py's WATCH pipeline: WATCH, MGET, MULTI..EXEC,
                 SET): 4 round trips
  xadd           a bare XADD (no idempotency: the floor, not a candidate)
forward (the verifier's, `StreamConsumer.forward`: append + XACK of the input + HDEL of its
error and attempts):
  lua            `StreamConsumer.forward`: the script does all of it, 1 round trip
  lua-3rt        the script (append + XACK), then the 2 HDEL on their own: 3 round trips (the
                 forward before issue 35's change)
  multi          WATCH + GET; MULTI XADD, SET, XACK, HDEL, HDEL, EXEC; SET id: 3 round trips

Run: `python -m benchmarks.bench_stream_appends` (`--sizes 4096 34816 --n 2000 --rounds 3`;
`--quick`: 100 appends, 1 round, seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from shellrl.streams import OutgoingEntry, StreamConsumer, StreamProducer, connect
from shellrl.streams.entry import StreamEntry, _flat_fields, _s
from shellrl.streams.keys import idempotency_key

REPO = Path(__file__).resolve().parents[1]
IN, OUT, GROUP = "shellrl:bench:in", "shellrl:bench:out", "bench"
FIELDS = {"task_id": "arith-0001234", "group_id": "g-0123456789abcdef", "version": 40}


class WatchedProducer(StreamProducer):
    """The payload-outside-Lua append, prototyped: WATCH + GET of the idempotency key in one round
    trip, then MULTI (XADD, SET key ?, optional XACK and HDELs) EXEC in a second, then the entry
    id recorded in a third (`record`)."""

    async def _add_watched(
        self,
        e: OutgoingEntry,
        ack: tuple[str, str, str] | None = None,
        hdel: tuple[tuple[str, str], ...] = (),
        *,
        record: bool = True,
    ) -> tuple[str, bool]:
        key = idempotency_key(self.stream, e.idempotency_key)
        flat = [x for item in _flat_fields(e).items() for x in item]
        after = [("XACK", *ack)] if ack else []
        after += [("HDEL", k, f) for k, f in hdel]
        pool = self.redis.connection_pool
        conn = await pool.get_connection()
        try:
            for _ in range(20):
                _, existing = await _roundtrip(conn, ("WATCH", key), ("GET", key))
                if existing is not None:
                    await _roundtrip(conn, ("UNWATCH",), *after)
                    return _s(existing).removeprefix("?"), True
                *_, done = await _roundtrip(
                    conn,
                    ("MULTI",),
                    ("XADD", self.stream, "*", *flat),
                    ("SET", key, "?", "EX", self.idempotency_ttl_s),
                    *after,
                    ("EXEC",),
                )
                if done is None:
                    continue  # the key changed after WATCH: look again
                entry_id = _s(done[0])
                if record:
                    await _roundtrip(conn, ("SET", key, entry_id, "XX", "KEEPTTL"))
                return entry_id, False
            raise RuntimeError("idempotency key kept changing")
        except BaseException:
            await conn.disconnect()  # drops WATCH/MULTI state with the connection
            raise
        finally:
            await pool.release(conn)


async def forward_3rt(consumer: StreamConsumer, entry: StreamEntry, to: StreamProducer, pb, key):
    """`StreamConsumer.forward` as it was before issue 35's change: the script (append + XACK),
    then HDEL of the entry's error and attempts, each its own round trip."""
    consumer._ledger.done(entry.entry_id)
    out = await to._add_one(OutgoingEntry(pb, key, FIELDS), ack=(IN, GROUP, entry.entry_id))
    await consumer.redis.hdel(consumer._ledger.error_key, entry.entry_id)
    await consumer.redis.hdel(consumer._ledger.attempts_key, entry.entry_id)
    return out


async def _roundtrip(conn, *commands: tuple) -> list:
    await conn.send_packed_command(conn.pack_commands(commands))
    out = [await conn.read_response() for _ in commands]
    for r in out[-1] if isinstance(out[-1], list) else ():
        if isinstance(r, Exception):
            raise r
    return out


async def server_counters(redis) -> dict[str, float]:
    """CPU seconds (process, main thread), commands processed, and commandstats usec by command."""
    cpu = await redis.info("cpu")
    stats = await redis.info("stats")
    cmd = await redis.info("commandstats")
    out = {
        "cpu_s": cpu["used_cpu_sys"] + cpu["used_cpu_user"],
        "main_s": cpu["used_cpu_sys_main_thread"] + cpu["used_cpu_user_main_thread"],
        "commands": stats["total_commands_processed"],
        "read_events": stats.get("total_reads_processed", 0),
    }
    for name, v in cmd.items():
        out[f"usec:{name.removeprefix('cmdstat_')}"] = v["usec"]
        out[f"calls:{name.removeprefix('cmdstat_')}"] = v["calls"]
    return out


def _delta(before: dict, after: dict, n: int, info_calls: int = 3) -> dict[str, float]:
    """Per-append differences; the INFO calls of the window's end are taken out of the counts."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    script = d.get("usec:evalsha", 0)
    other = sum(
        v for k, v in d.items() if k.startswith("usec:") and k not in ("usec:info", "usec:evalsha")
    )
    return {
        "cpu_us": d["cpu_s"] * 1e6 / n,
        "main_us": d["main_s"] * 1e6 / n,
        "cmds": (d["commands"] - info_calls) / n,
        "reads": (d["read_events"] - info_calls) / n,
        "script_usec": script / n,
        "other_usec": other / n,
    }


async def _prepare_inputs(redis, n: int) -> list[StreamEntry]:
    """`n` small entries in IN, delivered to one consumer of GROUP (pending, as a verifier holds
    them while scoring)."""
    await redis.delete(IN)
    await redis.xgroup_create(IN, GROUP, id="0", mkstream=True)
    async with redis.pipeline(transaction=False) as pipe:
        for i in range(n):
            pipe.xadd(IN, {"pb": b"x" * 64, "task_id": f"t{i}"})
        await pipe.execute()
    resp = await redis.xreadgroup(GROUP, "c1", {IN: ">"}, count=n)
    return [StreamEntry(IN, eid.decode(), f) for _, entries in resp for eid, f in entries]


async def measure(url: str, kind: str, variant: str, size: int, n: int, tag: str) -> dict:
    redis = connect(url)
    await redis.flushall()
    producer = WatchedProducer(redis, OUT)
    consumer = StreamConsumer(redis, IN, GROUP, "c1", block_ms=1000, claim_interval_s=3600)
    payload = os.urandom(size)
    inputs = await _prepare_inputs(redis, n) if kind == "forward" else []
    keys = [f"{tag}-{i:07d}" for i in range(n)]
    one: Callable[[int], Awaitable[object]]
    if kind == "add" and variant == "lua":
        one = lambda i: producer.add(payload, idempotency_key=keys[i], **FIELDS)  # noqa: E731
    elif kind == "add" and variant in ("multi", "multi-norecord"):
        record = variant == "multi"
        one = lambda i: producer._add_watched(  # noqa: E731
            OutgoingEntry(payload, keys[i], FIELDS), record=record
        )
    elif kind == "add" and variant == "multi-std":
        one = lambda i: producer.add_many([OutgoingEntry(payload, keys[i], FIELDS)])  # noqa: E731
    elif kind == "add" and variant == "xadd":
        flat = {"pb": payload, **{k: str(v) for k, v in FIELDS.items()}}
        one = lambda i: redis.xadd(OUT, flat)  # noqa: E731
    elif kind == "forward" and variant == "lua":
        one = lambda i: consumer.forward(  # noqa: E731
            inputs[i], producer, payload, idempotency_key=keys[i], **FIELDS
        )
    elif kind == "forward" and variant == "lua-3rt":
        one = lambda i: forward_3rt(consumer, inputs[i], producer, payload, keys[i])  # noqa: E731
    elif kind == "forward" and variant == "multi":
        ledger = consumer._ledger
        one = lambda i: producer._add_watched(  # noqa: E731
            OutgoingEntry(payload, keys[i], FIELDS),
            ack=(IN, GROUP, inputs[i].entry_id),
            hdel=(
                (ledger.error_key, inputs[i].entry_id),
                (ledger.attempts_key, inputs[i].entry_id),
            ),
        )
    else:
        raise ValueError(f"unknown variant {kind}/{variant}")
    await one(0)  # warm: script loaded, connection open
    before = await server_counters(redis)
    for i in range(1, n):
        await one(i)
    after = await server_counters(redis)
    await redis.aclose()
    return _delta(before, after, n - 1)


VARIANTS = {
    "add": ("lua", "multi", "multi-norecord", "multi-std", "xadd"),
    "forward": ("lua", "lua-3rt", "multi"),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench_stream_appends", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 34816])
    p.add_argument("--n", type=int, default=2000, help="appends per variant and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", default="", help="comma-separated kind/variant, e.g. add/lua")
    p.add_argument("--quick", action="store_true", help="100 appends, 1 round (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.rounds = 100, 1
    sys.path.insert(0, str(REPO))
    from tests.helpers.redis_server import RedisServer

    plan = [(k, v) for k, vs in VARIANTS.items() for v in vs]
    if args.only:
        plan = [kv for kv in plan if "/".join(kv) in args.only.split(",")]
    results: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="shellrl-bench-appends-") as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            for r in range(args.rounds):
                for size in args.sizes:
                    for kind, variant in plan:  # interleaved: drift hits every variant alike
                        res = asyncio.run(measure(server.url, kind, variant, size, args.n, f"r{r}"))
                        results.setdefault((kind, variant, size), []).append(res)
        finally:
            server.stop()
    cols = ("cpu_us", "main_us", "script_usec", "other_usec", "cmds", "reads")
    print(
        f"Redis server per append: median of {args.rounds} rounds x {args.n} appends, "
        "one in flight; ratio = cpu_us / the Lua variant's of the same kind and size"
    )
    print(
        f"{'kind':8} {'variant':15} {'bytes':>6} " + " ".join(f"{c:>9}" for c in cols) + "  ratio"
    )
    for size in args.sizes:
        for kind, variant in plan:
            rows = results[(kind, variant, size)]
            med = {c: statistics.median(r[c] for r in rows) for c in cols}
            base = results.get((kind, "lua", size))
            ratio = med["cpu_us"] / statistics.median(r["cpu_us"] for r in base) if base else 0
            runs = "/".join(f"{r['cpu_us']:.1f}" for r in rows)
            print(
                f"{kind:8} {variant:15} {size:>6} "
                + " ".join(f"{med[c]:>9.2f}" for c in cols)
                + f"  {ratio:.2f}x  (cpu_us runs {runs})"
            )


if __name__ == "__main__":
    main()
