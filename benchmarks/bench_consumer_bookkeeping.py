"""What a consumer's per-entry bookkeeping costs the Redis server and the consumer (issue 35).

Two forms of each, against a fresh real redis-server (AOF everysec, tests/helpers/redis_server.py),
interleaved for `--rounds` rounds, `--batch` entries a read:

hand-out (every consumer's `read`: one handling attempt counted per entry, deliveries.py):
  pipeline       one HINCRBY an entry in one pipeline (before)
  script         `DeliveryLedger.hand_out`: one script call with every id (now)
task statistics (the gateway's stats consumer, services/rollout/stats.py: per scored trajectory
the task-statistics script and the group-accounting script):
  one-by-one     each script call its own round trip (before: 2 an entry)
  batched        `run_scripts`: the batch's calls pipelined in one round trip (now)

Per entry: the server's CPU (INFO `used_cpu_sys` + `used_cpu_user`: command execution and the
socket work commandstats leaves out), the client's CPU (`time.process_time`, this process: redis-py
packing and parsing) and wall time, after an unmeasured pass of every form. Medians over the
rounds; each form's ratio to the first of its kind. Run: `python -m
benchmarks.bench_consumer_bookkeeping` (`--batch 16 --reads 300 --rounds 3`; `--quick`: 30 reads,
1 round).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from services.rollout.admission import Admission  # noqa: E402
from services.rollout.policy_version import PolicyVersionWatcher  # noqa: E402
from services.rollout.task_store import TaskStore  # noqa: E402
from shellrl.contract import task_from_json  # noqa: E402
from shellrl.streams import connect  # noqa: E402
from shellrl.streams.deliveries import DeliveryLedger  # noqa: E402
from shellrl.streams.script_batch import run_scripts  # noqa: E402
from tests.helpers.redis_server import RedisServer  # noqa: E402
from tests.helpers.trajectories import make_trajectory  # noqa: E402

console = Console(width=160)
TASK = task_from_json(
    {
        "task_id": "t-5",
        "instruction": "Say 5.",
        "check": {"type": "answer_integer_equals", "expected": 5},
    }
)


async def _server_cpu_s(redis) -> float:
    info = await redis.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def _measure(redis, form: Callable[[int], Awaitable[None]], reads: int, batch: int) -> dict:
    await form(0)  # scripts loaded, connections open
    server0, client0, wall0 = await _server_cpu_s(redis), time.process_time(), time.perf_counter()
    for i in range(1, reads + 1):
        await form(i)
    wall = time.perf_counter() - wall0
    client = time.process_time() - client0
    server = await _server_cpu_s(redis) - server0
    n = reads * batch
    return {"server_us": 1e6 * server / n, "client_us": 1e6 * client / n, "wall_us": 1e6 * wall / n}


def _forms(redis, batch: int) -> dict[str, dict[str, Callable[[int], Awaitable[None]]]]:
    ledger = DeliveryLedger(
        redis, "shellrl:bench", "bench", max_deliveries=5, dead_stream="d", dead_maxlen=10
    )
    fresh = itertools.count()  # every call's entries and trajectories are new ones

    def ids(_: int) -> list[str]:
        first = next(fresh)
        return [f"{1733400000000 + first}-{k}" for k in range(batch)]

    async def hand_out_pipeline(i: int) -> None:
        async with redis.pipeline(transaction=False) as pipe:
            for eid in ids(i):
                pipe.hincrby(ledger.attempts_key, eid, 1)
            await pipe.execute()

    async def hand_out_script(i: int) -> None:
        handed = ids(i)
        await ledger.hand_out([(eid, {b"pb": b""}) for eid in handed])
        ledger.done(*handed)

    store = TaskStore(redis)
    admission = Admission(
        redis, PolicyVersionWatcher(redis), replica="b", max_staleness=1, groups_per_step=1
    )

    def calls(_: int) -> list:
        out, first = [], next(fresh)
        for k in range(batch):
            t = make_trajectory(f"g-{first}", float(k % 2), trajectory_id=f"t-{first}-{k}")
            out.append(store.record_scored_call(TASK.task_id, t.trajectory_id, 1.0, scored=True))
            out.append(admission.member_scored_call(t))
        return out

    async def stats_one_by_one(i: int) -> None:
        for call in calls(i):
            await call.script(keys=call.keys, args=call.args)

    async def stats_batched(i: int) -> None:
        await run_scripts(redis, calls(i))

    return {
        "hand-out": {"pipeline": hand_out_pipeline, "script": hand_out_script},
        "task statistics": {"one-by-one": stats_one_by_one, "batched": stats_batched},
    }


async def run(batch: int, reads: int, rounds: int) -> Table:
    with tempfile.TemporaryDirectory(prefix="bench-bookkeeping-") as tmp:
        server = RedisServer(Path(tmp)).start()
        redis = connect(server.url)
        try:
            await TaskStore(redis).submit(TASK)
            forms = _forms(redis, batch)
            for by_name in forms.values():  # warm the server for every form (allocations, AOF)
                for form in by_name.values():
                    for i in range(max(1, reads // 5)):
                        await form(i)
            results: dict[tuple[str, str], list[dict]] = {}
            for _ in range(rounds):
                for kind, by_name in forms.items():
                    for name, form in by_name.items():
                        results.setdefault((kind, name), []).append(
                            await _measure(redis, form, reads, batch)
                        )
        finally:
            await redis.aclose()
            server.stop()
    table = Table(
        title=f"Consumer bookkeeping per entry ({batch} entries a read, {reads} reads, "
        f"{rounds} round(s), medians; ratio to the first form of its kind)"
    )
    for c in ("bookkeeping", "form", "server CPU µs", "ratio", "client CPU µs", "ratio", "wall µs"):
        table.add_column(c, justify="left" if c in ("bookkeeping", "form") else "right")
    for kind, by_name in forms.items():
        base = None
        for name in by_name:
            med = {
                k: statistics.median(r[k] for r in results[(kind, name)])
                for k in results[(kind, name)][0]
            }
            base = base or med
            table.add_row(
                kind,
                name,
                f"{med['server_us']:.2f}",
                f"{med['server_us'] / base['server_us']:.2f}x",
                f"{med['client_us']:.2f}",
                f"{med['client_us'] / base['client_us']:.2f}x",
                f"{med['wall_us']:.2f}",
            )
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_consumer_bookkeeping", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--batch", type=int, default=16, help="entries a read (default 16)")
    parser.add_argument(
        "--reads", type=int, help="reads each form measures in a round (default 300; quick 30)"
    )
    parser.add_argument(
        "--rounds", type=int, help="rounds, the forms interleaved (default 3; quick 1)"
    )
    parser.add_argument("--quick", action="store_true", help="30 reads, 1 round: a check it runs")
    args = parser.parse_args(argv)
    args.reads = args.reads or (30 if args.quick else 300)
    args.rounds = args.rounds or (1 if args.quick else 3)
    console.print(asyncio.run(run(args.batch, args.reads, args.rounds)))


if __name__ == "__main__":
    main()
