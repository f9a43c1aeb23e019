"""A stream consumer as a real process, for crash tests: `python -m tests.helpers.stream_worker`.

Handling an entry has one effect: its trajectory appended to `--effects` under the idempotency
key `trajectory_id` (what a real stage does: hand on downstream, then acknowledge).

--mode crash: read `--expect` entries, apply the effect to the first `--effects-before-crash`
of them WITHOUT acknowledging (a stage that produced but died before XACK), write
`--ready-file`, then sleep until killed.
--mode drain: handle entries (re-claimed ones included) with `forward` (effect + ack in one
script) until the group has nothing pending or undelivered; print {"handled", "duplicates"} as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from shellrl.contract import parse_trajectory
from shellrl.streams import StreamConsumer, StreamProducer, connect


async def _run(args: argparse.Namespace) -> None:
    redis = connect(args.url)
    consumer = StreamConsumer(
        redis,
        args.stream,
        args.group,
        args.consumer,
        block_ms=200,
        count=args.count,
        claim_min_idle_ms=args.claim_min_idle_ms,
        claim_interval_s=0.0,
    )
    effects = StreamProducer(redis, args.effects)
    if args.mode == "crash":
        seen = []
        while len(seen) < args.expect:
            seen += await consumer.read()
        for entry in seen[: args.effects_before_crash]:
            traj = parse_trajectory(entry.pb)
            await effects.add(entry.pb, idempotency_key=traj.trajectory_id)
        Path(args.ready_file).write_text(json.dumps([e.entry_id for e in seen]))
        while True:
            await asyncio.sleep(3600)
    handled = duplicates = 0
    deadline = time.monotonic() + args.timeout_s
    while time.monotonic() < deadline:
        entries = await consumer.read()
        for entry in entries:
            traj = parse_trajectory(entry.pb)
            _, dup = await consumer.forward(
                entry, effects, entry.pb, idempotency_key=traj.trajectory_id
            )
            handled += 1
            duplicates += dup
        if not entries and await effects_backlog(consumer) == 0:
            break
    print(json.dumps({"handled": handled, "duplicates": duplicates}), flush=True)
    await redis.aclose()


async def effects_backlog(consumer: StreamConsumer) -> int:
    return await StreamProducer(consumer.redis, consumer.stream).backlog(consumer.group)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--stream", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--consumer", required=True)
    p.add_argument("--effects", required=True)
    p.add_argument("--mode", choices=("crash", "drain"), required=True)
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--expect", type=int, default=0)
    p.add_argument("--effects-before-crash", type=int, default=0)
    p.add_argument("--ready-file", default="")
    p.add_argument("--claim-min-idle-ms", type=int, default=60_000)
    p.add_argument("--timeout-s", type=float, default=60.0)
    asyncio.run(_run(p.parse_args()))


if __name__ == "__main__":
    main()
