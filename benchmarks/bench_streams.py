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
import timeit
from pathlib import Path

import numpy as np
import orjson

from shellrl import contract
from shellrl.contract import SamplingParams, ToolEvent, Trajectory
from shellrl.streams import OutgoingEntry, StreamConsumer, StreamProducer, connect

REPO = Path(__file__).resolve().parents[1]
STREAM, GROUP = "shellrl:bench", "bench"
PROMPT_TOKENS = 596
SEGMENT_TOKENS = (1200, 300, 1000, 400, 600)  # ACTION, OBSERVATION, ACTION, OBSERVATION, ACTION
FORMATS = ("pb-bytes", "pb-packed", "json", "pb-bytes@1")
LABELS = {
    "pb-bytes": "protobuf, raw LE bytes (contract)",
    "pb-packed": "protobuf, packed repeated",
    "json": "JSON (orjson, lists)",
    "pb-bytes@1": "protobuf, raw LE bytes, one add() per trajectory",
}


# --- the content: a trajectory as plain Python values ------------------------------------


def make_contents(k: int = 8, seed: int = 0) -> list[dict]:
    """k different 4,096-token trajectories as dicts of Python lists (JSON-ready)."""
    rng = np.random.default_rng(seed)
    out = []
    for j in range(k):
        segments = []
        for i, n in enumerate(SEGMENT_TOKENS):
            action = i % 2 == 0
            segments.append(
                {
                    "kind": 1 if action else 2,
                    "policy_version": 40 + j if action else -1,
                    "token_ids": rng.integers(0, 49_152, n).tolist(),
                    "logprobs": (-rng.exponential(2.0, n)).astype(np.float32).tolist()
                    if action
                    else [0.0] * n,
                    "loss_mask": [1 if action else 0] * n,
                    "finish_reason": 1 if action else 0,
                    "request_id": f"req-{j}-{i}" if action else "",
                    "turn": i // 2,
                    "command": "" if action else "find . -name '*.log' | wc -l",
                    "exit_code": 0,
                }
            )
        out.append(
            {
                "task_id": f"agentbench-os-train-{j:04d}",
                "group_id": f"group-{j}",
                "attempt": 0,
                "prompt_ids": rng.integers(0, 49_152, PROMPT_TOKENS).tolist(),
                "segments": segments,
                "reward": 1.0,
                "terminated": True,
            }
        )
    return out


# --- encoders / decoders --------------------------------------------------------------------


def encode_pb_bytes(c: dict, trajectory_id: str) -> bytes:
    segments = []
    for s in c["segments"]:
        if s["kind"] == 1:
            segments.append(
                contract.action_segment(
                    s["token_ids"],
                    s["logprobs"],
                    s["policy_version"],
                    finish_reason=s["finish_reason"],
                    request_id=s["request_id"],
                    turn=s["turn"],
                    sampling=SamplingParams(temperature=1.0, top_p=1.0),
                )
            )
        else:
            segments.append(
                contract.observation_segment(
                    s["token_ids"],
                    tool_event=ToolEvent(command=s["command"], exit_code=s["exit_code"]),
                    turn=s["turn"],
                )
            )
    return Trajectory(
        trajectory_id=trajectory_id,
        task_id=c["task_id"],
        group_id=c["group_id"],
        attempt=c["attempt"],
        prompt_ids=contract.encode_token_ids(c["prompt_ids"]),
        segments=segments,
        reward=c["reward"],
        terminated=c["terminated"],
    ).SerializeToString()


def decode_pb_bytes(raw: bytes) -> tuple:
    a = contract.trajectory_arrays(contract.parse_trajectory(raw))
    return a.prompt_ids, a.response_ids, a.behavior_logprobs, a.loss_mask


_PACKED_CLASS = None


def packed_trajectory_class():
    """The contract's Trajectory/Segment with packed repeated per-token arrays (benchmark only)."""
    global _PACKED_CLASS
    if _PACKED_CLASS is None:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

        F = descriptor_pb2.FieldDescriptorProto
        opt, rep = F.LABEL_OPTIONAL, F.LABEL_REPEATED
        fdp = descriptor_pb2.FileDescriptorProto(
            name="shellrl_bench_packed.proto", package="shellrl.bench", syntax="proto3"
        )
        seg = fdp.message_type.add(name="PackedSegment")
        for number, name, label, kind in [
            (1, "kind", opt, F.TYPE_INT32),
            (2, "policy_version", opt, F.TYPE_INT64),
            (3, "token_ids", rep, F.TYPE_INT32),
            (4, "logprobs", rep, F.TYPE_FLOAT),
            (5, "loss_mask", rep, F.TYPE_BOOL),
            (6, "finish_reason", opt, F.TYPE_INT32),
            (7, "request_id", opt, F.TYPE_STRING),
            (10, "turn", opt, F.TYPE_UINT32),
            (11, "command", opt, F.TYPE_STRING),
            (12, "exit_code", opt, F.TYPE_INT32),
        ]:
            seg.field.add(name=name, number=number, label=label, type=kind)
        traj = fdp.message_type.add(name="PackedTrajectory")
        for number, name, label, kind in [
            (1, "trajectory_id", opt, F.TYPE_STRING),
            (2, "task_id", opt, F.TYPE_STRING),
            (3, "group_id", opt, F.TYPE_STRING),
            (4, "attempt", opt, F.TYPE_UINT32),
            (8, "prompt_ids", rep, F.TYPE_INT32),
            (10, "reward", opt, F.TYPE_DOUBLE),
            (12, "terminated", opt, F.TYPE_BOOL),
        ]:
            traj.field.add(name=name, number=number, label=label, type=kind)
        traj.field.add(
            name="segments",
            number=9,
            label=rep,
            type=F.TYPE_MESSAGE,
            type_name=".shellrl.bench.PackedSegment",
        )
        pool = descriptor_pool.DescriptorPool()
        pool.Add(fdp)
        _PACKED_CLASS = message_factory.GetMessageClass(
            pool.FindMessageTypeByName("shellrl.bench.PackedTrajectory")
        )
    return _PACKED_CLASS


def encode_pb_packed(c: dict, trajectory_id: str) -> bytes:
    cls = packed_trajectory_class()
    return cls(
        trajectory_id=trajectory_id,
        task_id=c["task_id"],
        group_id=c["group_id"],
        attempt=c["attempt"],
        prompt_ids=c["prompt_ids"],
        segments=c["segments"],
        reward=c["reward"],
        terminated=c["terminated"],
    ).SerializeToString()


def _flat(prompt, segments, get) -> tuple:
    ids, lps, masks = [], [], []
    for s in segments:
        t, lp, m = (
            np.array(get(s, "token_ids"), np.int32),
            np.array(get(s, "logprobs"), np.float32),
            np.array(get(s, "loss_mask"), np.uint8),
        )
        if not (len(t) == len(lp) == len(m)):
            raise ValueError("segment arrays disagree in length")
        ids.append(t)
        lps.append(lp)
        masks.append(m)
    return (
        np.array(prompt, np.int32),
        np.concatenate(ids),
        np.concatenate(lps),
        np.concatenate(masks),
    )


def decode_pb_packed(raw: bytes) -> tuple:
    msg = packed_trajectory_class().FromString(raw)
    return _flat(msg.prompt_ids, msg.segments, getattr)


def encode_json(c: dict, trajectory_id: str) -> bytes:
    return orjson.dumps({"trajectory_id": trajectory_id, **c})


def decode_json(raw: bytes) -> tuple:
    obj = orjson.loads(raw)
    return _flat(obj["prompt_ids"], obj["segments"], dict.__getitem__)


CODECS = {
    "pb-bytes": (encode_pb_bytes, decode_pb_bytes),
    "pb-packed": (encode_pb_packed, decode_pb_packed),
    "json": (encode_json, decode_json),
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


def codec_micro(number: int = 50, repeat: int = 5) -> dict[str, dict[str, float]]:
    """Encode / decode time per trajectory in this process (best of `repeat`), µs."""
    c = make_contents(1)[0]
    out = {}
    for fmt, (enc, dec) in CODECS.items():
        raw = enc(c, "micro")
        got = dec(raw)
        want = decode_pb_bytes(encode_pb_bytes(c, "micro"))
        assert all(np.array_equal(a, b) for a, b in zip(got, want)), f"{fmt} is not lossless"
        e = (
            min(timeit.repeat(lambda enc=enc: enc(c, "micro"), number=number, repeat=repeat))
            / number
            * 1e6
        )
        d = (
            min(timeit.repeat(lambda dec=dec, raw=raw: dec(raw), number=number, repeat=repeat))
            / number
            * 1e6
        )
        out[fmt] = {"encode_us": e, "decode_us": d, "bytes": len(raw)}
    return out


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
