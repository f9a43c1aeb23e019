"""Trajectories per second through one Redis stream: protobuf vs JSON (issue 2).

One producer PROCESS encodes 4,096-token trajectories (596 prompt tokens, 3 ACTION and
2 OBSERVATION segments) from Python lists, the form the engine's JSON gives, and appends them
with `StreamProducer.add_many` (idempotency key = trajectory_id, routing fields, MAXLEN trimming
of acknowledged entries). One consumer PROCESS reads them in its group with `StreamConsumer.read`
(XREADGROUP COUNT), decodes each into flat numpy arrays (token ids int32, behavior log-probs
float32, loss mask uint8: what the learner needs) and acknowledges each batch. Throughput = N /
(last acknowledgement - first add), both on the system-wide monotonic clock.

Wire forms of the same content, measured in the same run against a real redis-server with AOF
`appendfsync everysec` (the test fixture's configuration):
  protobuf, raw LE bytes   the contract (shellrl/v1/trajectory.proto): per-token arrays as bytes
  protobuf, packed         the same messages with packed `repeated int32/float/bool` arrays
                           (built at run time from a descriptor; not part of the contract)
  JSON (orjson)            the same fields, per-token arrays as JSON lists

The content and the three codecs are in benchmarks/stream_codecs.py.

Run: `python -m benchmarks streams` (or `python -m benchmarks.bench_streams --n 3000 --rounds 3`;
`--quick`: protobuf and JSON, 100 trajectories, 1 round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.stream_codecs import CODECS, codec_micro, make_contents
from shellrl.streams import OutgoingEntry, StreamConsumer, StreamProducer, connect

REPO = Path(__file__).resolve().parents[1]
STREAM, GROUP = "shellrl:bench", "bench"
FORMATS = ("pb-bytes", "pb-packed", "json", "pb-bytes@1")
LABELS = {
    "pb-bytes": "protobuf, raw LE bytes (contract)",
    "pb-packed": "protobuf, packed repeated",
    "json": "JSON (orjson, lists)",
    "pb-bytes@1": "protobuf, raw LE bytes, one add() per trajectory",
}


# --- the two processes ----------------------------------------------------------------------


async def run_producer(url: str, fmt: str, n: int, batch: int) -> dict:
    """Encode and append `n` trajectories; one `add_many` round trip stays in flight while the
    next batch is encoded (yielding between trajectories), as a rollout service with many
    concurrent episodes would overlap them."""
    encode = CODECS[fmt][0]
    contents = make_contents()
    redis = connect(url)
    producer = StreamProducer(redis, STREAM, maxlen=2_000, trim_every=500)
    start = time.monotonic()
    pending: list[OutgoingEntry] = []
    in_flight: asyncio.Task | None = None
    total_bytes = 0
    for i in range(n):
        c = contents[i % len(contents)]
        tid = f"{fmt}-{i:06d}"
        pb = encode(c, tid)
        total_bytes += len(pb)
        pending.append(
            OutgoingEntry(
                pb, tid, {"task_id": c["task_id"], "group_id": c["group_id"], "version": 40}
            )
        )
        if len(pending) == batch or i == n - 1:
            if in_flight is not None:
                await in_flight
            one = pending[0]
            in_flight = asyncio.create_task(
                producer.add(one.pb, idempotency_key=one.idempotency_key, **one.fields)
                if batch == 1
                else producer.add_many(pending)
            )
            pending = []
        await asyncio.sleep(0)  # let the in-flight round trip send and receive
    await in_flight
    end = time.monotonic()
    await redis.aclose()
    return {"start": start, "end": end, "bytes_per_trajectory": total_bytes / n}


async def run_consumer(url: str, fmt: str, n: int, count: int) -> dict:
    decode = CODECS[fmt][1]
    redis = connect(url)
    consumer = StreamConsumer(
        redis, STREAM, GROUP, "consumer-1", block_ms=1000, count=count, claim_interval_s=3600
    )
    await consumer.ensure_group()
    print("ready", flush=True)
    done = tokens = 0
    first = None
    while done < n:
        entries = await consumer.read()
        if entries and first is None:
            first = time.monotonic()
        for e in entries:
            tokens += len(decode(e.pb)[1])
        await consumer.ack(*(e.entry_id for e in entries))
        done += len(entries)
    end = time.monotonic()
    await redis.aclose()
    return {"first": first, "end": end, "response_tokens": tokens}


def _child(args: argparse.Namespace) -> None:
    if args.role == "producer":
        out = asyncio.run(run_producer(args.url, args.format, args.n, args.batch))
    else:
        out = asyncio.run(run_consumer(args.url, args.format, args.n, args.count))
    print(json.dumps(out), flush=True)


# --- orchestration --------------------------------------------------------------------------


def _spawn(url: str, role: str, fmt: str, args: argparse.Namespace) -> subprocess.Popen:
    codec, _, batch = fmt.partition("@")
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_streams",
        "--role",
        role,
        "--url",
        url,
        "--format",
        codec,
        "--n",
        str(args.n),
        "--batch",
        batch or str(args.batch),
        "--count",
        str(args.count),
    ]
    return subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def run_once(url: str, fmt: str, args: argparse.Namespace) -> dict:
    """One producer process and one consumer process through a fresh stream; returns measurements.

    `fmt` is a codec name, optionally with `@B`: the producer appends B entries per round trip
    (`@1`: one `add` per trajectory) instead of `--batch`."""
    import redis as sync_redis

    sync_redis.Redis.from_url(url).flushall()
    consumer = _spawn(url, "consumer", fmt, args)
    try:
        line = consumer.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"consumer did not start: {line}{consumer.stderr.read()}")
        producer = _spawn(url, "producer", fmt, args)
        p_out, p_err = producer.communicate(timeout=600)
        c_out, c_err = consumer.communicate(timeout=600)
    finally:
        for proc in (consumer, locals().get("producer")):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    if producer.returncode or consumer.returncode:
        raise RuntimeError(
            f"{fmt}: producer rc={producer.returncode} {p_err[-2000:]} "
            f"consumer rc={consumer.returncode} {c_err[-2000:]}"
        )
    p, c = json.loads(p_out.splitlines()[-1]), json.loads(c_out.splitlines()[-1])
    seconds = c["end"] - p["start"]
    return {
        "trajectories_per_s": args.n / seconds,
        "produce_per_s": args.n / (p["end"] - p["start"]),
        "bytes_per_trajectory": p["bytes_per_trajectory"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench_streams", description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=3000, help="trajectories per run")
    p.add_argument("--rounds", type=int, default=3, help="runs per format (median reported)")
    p.add_argument(
        "--batch", type=int, default=32, help="producer: entries per add_many round trip"
    )
    p.add_argument("--count", type=int, default=64, help="consumer: XREADGROUP COUNT")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--role", choices=("producer", "consumer"), help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--format", help=argparse.SUPPRESS)
    p.add_argument(
        "--quick",
        action="store_true",
        help="protobuf and JSON only, 100 trajectories, 1 round (a smoke run: seconds)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.rounds, args.formats = 100, 1, "pb-bytes,json"
    if args.role:
        _child(args)
        return

    from rich.console import Console
    from rich.table import Table

    sys.path.insert(0, str(REPO))
    from tests.helpers.redis_server import RedisServer

    formats = [f for f in args.formats.split(",") if f]
    micro = codec_micro(*((10, 2) if args.quick else ()))
    results: dict[str, list[dict]] = {f: [] for f in formats}
    with tempfile.TemporaryDirectory(prefix="shellrl-bench-redis-") as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            for _ in range(args.rounds):
                for (
                    fmt
                ) in formats:  # interleaved, so drift of the shared machine hits every format alike
                    results[fmt].append(run_once(server.url, fmt, args))
        finally:
            server.stop()

    med = {f: statistics.median(r["trajectories_per_s"] for r in results[f]) for f in formats}
    baseline = med.get("json", next(iter(med.values())))
    table = Table(
        title=f"Streams: {args.n} trajectories of 4,096 tokens per run, one producer and one consumer "
        f"process, median of {args.rounds} ({len(os.sched_getaffinity(0))} CPUs usable)"
    )
    for col in (
        "wire form",
        "bytes / trajectory",
        "encode µs",
        "decode µs",
        "produce traj/s",
        "end-to-end traj/s",
        "runs traj/s",
        "vs JSON",
    ):
        table.add_column(col, justify="left" if col == "wire form" else "right")
    for f in formats:
        m = micro[f.partition("@")[0]]
        table.add_row(
            LABELS[f],
            f"{m['bytes']:,}",
            f"{m['encode_us']:.0f}",
            f"{m['decode_us']:.0f}",
            f"{statistics.median(r['produce_per_s'] for r in results[f]):,.0f}",
            f"{med[f]:,.0f}",
            " / ".join(f"{r['trajectories_per_s']:,.0f}" for r in results[f]),
            f"{med[f] / baseline:.2f}x",
        )
    Console(width=200).print(table)
    print(
        f"targets: protobuf >= 2,000 traj/s: {med.get('pb-bytes', 0):,.0f}; "
        f"protobuf >= 2x JSON: {med.get('pb-bytes', 0) / baseline:.2f}x"
    )


if __name__ == "__main__":
    main()
