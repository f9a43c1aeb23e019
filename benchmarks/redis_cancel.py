"""Diagnostic: how often a stream consumer in redis-py ignores a cancel, with redis-py's own
`Connection` against `shellrl.streams.CancelSafeConnection`, optionally on a busy machine.

    python -m benchmarks.redis_cancel [--rounds 5] [--cancels 200] [--busy 3]

The consumer is tests/service/test_cancel.py's back-to-back XREADGROUP + XADD loop on a real
redis-server. Each cancel lands at a random moment (0-20 ms after the start); "ignored" = still
running 1 s after that single cancel; "stuck" = still running after `cancel_and_wait` re-cancelled
it every second for 3 s (what failed in CI). `--busy N` runs N spinning processes meanwhile, as a
busy CI machine would. Not part of `make bench` (it loads every core on purpose).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import random
import sys
import tempfile
from pathlib import Path

import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from shellrl.service.aio import cancel_and_wait
from shellrl.streams import SOCKET_TIMEOUT_S, CancelSafeConnection
from tests.helpers.redis_server import RedisServer
from tests.service.test_cancel import consume_forever

CLASSES = {
    "redis-py Connection": aioredis.Connection,
    "CancelSafeConnection (shipped)": CancelSafeConnection,
}


def _spin() -> None:
    while True:
        pass


async def _round(url: str, connection_class, cancels: int, seed: int) -> tuple[int, int]:
    redis = aioredis.Redis.from_url(
        url, socket_timeout=SOCKET_TIMEOUT_S, connection_class=connection_class
    )
    try:
        await redis.xgroup_create("s", "g", id="0", mkstream=True)
    except Exception:  # the group exists from an earlier round
        pass
    rng, ignored, stuck = random.Random(seed), 0, 0
    try:
        for _ in range(cancels):
            task = asyncio.create_task(consume_forever(redis))
            await asyncio.sleep(rng.random() * 0.02)
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if not done:
                ignored += 1
                if not await cancel_and_wait(task, timeout_s=3.0):
                    stuck += 1
                    await cancel_and_wait(task, timeout_s=60.0)
    finally:
        await redis.aclose()
    return ignored, stuck


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.redis_cancel", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cancels", type=int, default=200, help="cancels per round")
    parser.add_argument("--busy", type=int, default=0, help="spinning processes meanwhile")
    args = parser.parse_args(argv)
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    server = RedisServer(Path(tempfile.mkdtemp(prefix="bench-cancel-"))).start()
    try:
        rows = []
        for name, cls in CLASSES.items():
            results = [
                asyncio.run(_round(server.url, cls, args.cancels, seed))
                for seed in range(args.rounds)
            ]
            rows.append((name, [r[0] for r in results], sum(r[1] for r in results)))
    finally:
        server.stop()
        for p in spinners:
            p.terminate()
    table = Table(
        title=f"{args.rounds} rounds x {args.cancels} cancels, {args.busy} busy processes, "
        f"Python {sys.version.split()[0]}"
    )
    for col in (
        "connection class",
        "ignored per round",
        "ignored in all",
        "stuck > 3 s of re-cancels",
    ):
        table.add_column(col, justify="right")
    for name, ignored, stuck in rows:
        table.add_row(name, " ".join(map(str, ignored)), str(sum(ignored)), str(stuck))
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
