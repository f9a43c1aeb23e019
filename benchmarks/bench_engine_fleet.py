"""Several engines (issue 18): `python -m benchmarks.bench_engine_fleet [--quick]`.

Real `python -m services.engine` processes (SmolLM2-135M-Instruct by default, `--threads` torch
threads each, prefix cache on), a real Redis, and the learner's and gateway's engine sides in
this process (tests/helpers/engine_fleet.py: WeightSync + EngineMembership as the learner runs
them, EngineClient + EngineDirectory as the gateway does) with the services' default intervals:
registry read every 1 s, learner loop tick 1 s (block_ms), engine heartbeat 2 s.

1. Join: engine A serves (registered) and the learner has published a version; engine B is
   started with SHELLRL_REGISTER_URL. Seconds from B's process start until it is ready (/readyz),
   registered (shellrl:engines), serving the current version (the learner's full push confirmed)
   and routable (the gateway sends it traffic); then B leaves (SIGTERM) and the next join starts
   a new process. Baseline in the same run: one full push of the current weights to an engine
   already in rotation (a learner step's push), median of `--pushes`.
2. Pinned vs unpinned episodes over the 2 engines, side by side: each of `--rounds` rounds runs
   `--episodes` pinned and `--episodes` unpinned episodes at the same time on the same engines
   (so the machine's load falls on both alike), each of `--turns` turns; the first request is the
   real chat prompt of a task instruction (system prompt + one-shot example), each turn samples a
   seeded uniform 8..`--new-tokens` tokens at T = 1 (EOS ignored: where a reply would meet its
   stop string), then a command "runs" for a seeded uniform 0..2x`--exec-ms` (the same draws in
   both modes) and a fixed tool response (tokenized once) is appended, as the agent loop does.
   Every request goes through `EnginePin` (the agent loop's engine choice), pinned or routed by
   load alone. Prefix-cache hit rate = cached / prompt tokens (the engines' `cached_tokens`);
   turn latency = one /generate round trip (p50, p90), for all turns and for turns after the
   first (where pinning matters).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from services.rollout.prompt import ChatFormat, load_chat_tokenizer, render_tool_response  # noqa: E402
from shellrl.clients.engine_registry import read_registrations  # noqa: E402
from tests.helpers.engine_fleet import (  # noqa: E402
    Answer,
    GatewaySide,
    LearnerSide,
    registering_engine,
    run_episode,
)
from tests.helpers.redis_server import RedisServer  # noqa: E402

console = Console(width=190)


async def _until(predicate, timeout_s: float = 600.0, poll_s: float = 0.02) -> float:
    """monotonic time at which predicate() (sync or async) first holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return time.monotonic()
        await asyncio.sleep(poll_s)
    raise TimeoutError("condition not reached")


async def join_once(learner: LearnerSide, gateway: GatewaySide, engine) -> dict[str, float]:
    """Start `engine` (a registering process) and time its join (see the module docstring)."""
    t0, ready_at = time.monotonic(), []

    async def start() -> None:
        await asyncio.to_thread(engine.start, 600)  # returns once /readyz answers 200
        ready_at.append(time.monotonic())

    started = asyncio.ensure_future(start())

    async def registered() -> bool:
        return engine.url in await read_registrations(learner.redis)

    def confirmed() -> bool:
        state = learner.sync.engines.get(engine.url)
        return bool(state and state.in_rotation and state.version == str(learner.version))

    t_registered = await _until(registered)
    t_confirmed = await _until(confirmed)
    t_routable = await _until(lambda: gateway.client.routing.is_routable(engine.url))
    await started
    return {
        "registered": t_registered - t0,
        "serving": t_confirmed - t0,
        "routable": t_routable - t0,
        "registered_to_serving": t_confirmed - t_registered,
        "registered_to_routable": t_routable - t_registered,
        "ready": ready_at[0] - t0,
    }


async def leave(learner: LearnerSide, engine) -> None:
    engine.signal(signal.SIGTERM)

    async def gone() -> bool:
        return engine.url not in await read_registrations(learner.redis)

    await _until(gone, 60)
    await _until(lambda: engine.url not in learner.sync.engines, 60)
    await asyncio.to_thread(engine.stop)


async def episodes(
    gateway, chat, observation, args, pinned: bool, tag: str, seed: int
) -> list[list[Answer]]:
    async def one(i: int) -> list[Answer]:
        rng = random.Random(seed * 1000 + i)
        prompt = chat.prompt_ids(f"Count the lines of report-{tag}-{i}.txt and answer the number.")
        episode = await run_episode(
            gateway,
            prompt,
            args.turns,
            f"{tag}-{i}",
            pinned=pinned,
            observation=observation,
            max_new_tokens=lambda: rng.randint(8, args.new_tokens),
            exec_s=lambda: rng.uniform(0, 2 * args.exec_ms / 1000),
        )
        return episode.answers

    return list(await asyncio.gather(*(one(i) for i in range(args.episodes))))


def _row(name: str, runs: list[list[Answer]], baseline_p50: float | None) -> list[str]:
    answers = [a for episode in runs for a in episode]
    later = [a for episode in runs for a in episode[1:]]
    hit = sum(a.cached_tokens for a in answers) / sum(a.prompt_tokens for a in answers)
    hit_later = sum(a.cached_tokens for a in later) / sum(a.prompt_tokens for a in later)
    prefill = statistics.mean(a.prompt_tokens - a.cached_tokens for a in answers)
    lat = sorted(a.latency_s for a in answers)
    lat_later = sorted(a.latency_s for a in later)
    engines = statistics.mean(len({a.engine for a in episode}) for episode in runs)
    moved = [b for episode in runs for a, b in zip(episode, episode[1:]) if a.engine != b.engine]
    hit_moved = (
        f"{100 * sum(a.cached_tokens for a in moved) / sum(a.prompt_tokens for a in moved):.1f}%"
        if moved
        else "-"
    )
    p50 = statistics.median(lat)
    return [
        name,
        str(len(answers)),
        f"{engines:.2f}",
        f"{100 * len(moved) / len(later):.0f}%",
        f"{100 * hit:.1f}%",
        f"{100 * hit_later:.1f}%",
        hit_moved,
        f"{prefill:.0f}",
        f"{1000 * p50:.0f}",
        f"{1000 * lat[int(0.9 * (len(lat) - 1))]:.0f}",
        f"{1000 * statistics.median(lat_later):.0f}",
        f"{p50 / baseline_p50:.2f}x" if baseline_p50 else "1.00x",
    ]


async def bench(args, work: Path) -> None:
    redis = RedisServer(work / "redis").start()
    env = {"SHELLRL_NUM_THREADS": str(args.threads), "SHELLRL_REGISTER_HEARTBEAT_S": "2"}
    a = registering_engine(redis.url, work, args.model, **env)
    await asyncio.to_thread(a.start, 600)
    learner = LearnerSide(
        redis.url, work / "sync", model_path=args.model, refresh_s=1.0, tick_s=1.0
    )
    gateway = GatewaySide(redis.url, refresh_s=1.0)
    stop = asyncio.Event()
    loops = [
        asyncio.create_task(learner.run(stop)),
        asyncio.create_task(gateway.watcher.run()),
        asyncio.create_task(gateway.directory.run(stop)),
    ]
    b = None
    try:
        await _until(
            lambda: learner.sync.engines.get(a.url) and learner.sync.engines[a.url].in_rotation
        )
        pushes = []
        for _ in range(args.pushes):
            t = time.monotonic()
            await learner.step()
            pushes.append(time.monotonic() - t)
        push_s = statistics.median(pushes)
        joins = []
        for _ in range(args.joins):
            if b is not None:
                await leave(learner, b)
            b = registering_engine(redis.url, work, args.model, **env)
            joins.append(await join_once(learner, gateway, b))
        table = Table(title=f"1. joining engine ({args.model}), seconds from process start")
        for column in ("join", "ready", "registered", "serving current version", "routable"):
            table.add_column(column, justify="right")
        table.add_column("registered -> routable", justify="right")
        table.add_column("x one full push", justify="right")
        for i, j in enumerate(joins):
            table.add_row(
                str(i + 1),
                f"{j['ready']:.1f}",
                f"{j['registered']:.1f}",
                f"{j['serving']:.1f}",
                f"{j['routable']:.1f}",
                f"{j['registered_to_routable']:.2f}",
                f"{j['registered_to_serving'] / push_s:.1f}x",
            )
        console.print(table)
        console.print(f"baseline: one full push to an engine in rotation, median {push_s:.3f} s")

        if not args.rounds:
            return
        chat = ChatFormat.from_tokenizer(load_chat_tokenizer(args.model))
        body = render_tool_response("\n".join(f"line {i}: ok" for i in range(8)), "", 0)
        observation = tuple(chat.observation_ids(body, []))
        await _until(lambda: len(gateway.client.routing.routable()) == 2, 60)
        results: dict[bool, list[list[Answer]]] = {True: [], False: []}
        for r in range(args.rounds):  # both modes at once, the same exec-time draws
            pinned, unpinned = await asyncio.gather(
                episodes(gateway, chat, observation, args, True, f"r{r}p", seed=r),
                episodes(gateway, chat, observation, args, False, f"r{r}u", seed=r),
            )
            results[True] += pinned
            results[False] += unpinned
        unpinned_p50 = statistics.median(a.latency_s for e in results[False] for a in e)
        table = Table(
            title=f"2. {args.episodes} pinned + {args.episodes} unpinned concurrent episodes x "
            f"{args.turns} turns on 2 engines, {args.rounds} rounds (prompt "
            f"{len(chat.prompt_ids('x'))} "
            f"tokens, observation {len(observation)}, 8..{args.new_tokens} new tokens per turn)"
        )
        for column in (
            "episodes",
            "requests",
            "engines/episode",
            "turns moved",
            "hit rate",
            "hit rate, turns > 1",
            "hit rate, moved turns",
            "prefill tokens/request",
            "latency p50 ms",
            "p90 ms",
            "p50 turns > 1 ms",
            "p50 x unpinned",
        ):
            table.add_column(column, justify="right")
        table.add_row(*_row("pinned (default)", results[True], unpinned_p50))
        table.add_row(*_row("unpinned (by load)", results[False], None))
        console.print(table)
    finally:
        stop.set()
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        await learner.close()
        await gateway.close()
        for engine in (a, b):
            if engine is not None:
                engine.stop()
        redis.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_engine_fleet", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny model, 1 join, 1 round of 2 + 2 episodes x 2 turns (a smoke run)",
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--exec-ms", type=float, default=100.0, help="mean command time per turn")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (0: joins only)")
    parser.add_argument("--joins", type=int, default=2)
    parser.add_argument("--pushes", type=int, default=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.rounds, args.joins, args.pushes = "tiny", 1, 1, 1
        args.episodes, args.turns, args.new_tokens, args.exec_ms = 2, 2, 16, 20.0
    console.print(
        f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; model "
        f"{args.model}, {args.threads} torch thread(s) per engine"
    )
    with tempfile.TemporaryDirectory(prefix="shellrl-bench-fleet-") as work:
        asyncio.run(bench(args, Path(work)))


if __name__ == "__main__":
    main()
