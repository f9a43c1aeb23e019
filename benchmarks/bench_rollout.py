"""Rollout gateway benchmarks (issue 5): `python -m benchmarks.bench_rollout [--quick]`.

1. Gateway overhead. The real agent loop (`AgentLoop` with the real `EngineClient`, `SandboxClient`,
   SmolLM2's tokenizer and chat template, protobuf trajectories XADDed to a real Redis) against a
   zero-latency FAKE engine (every reply `<bash>true</bash><|im_end|>`) and a zero-latency FAKE
   sandbox, each its own process (tests/fakes). 256 concurrent episodes of 8 turns, back to back.
   Baseline in the same run: the same two HTTP calls per turn (generate + exec) with the same
   clients and the same concurrency, without the agent loop. Also: latency of one turn with a single
   episode against one bare generate + exec pair (the added latency per turn), and the gateway
   process's CPU time per turn.
2. Long tail. The real scheduler, admission and worker (`RolloutWorker`, `Admission`, `TaskPool`,
   real Redis) with in-process FAKE engine and sandbox clients (tests/fakes) where the engine
   sleeps: every episode takes 10 s except one episode in every 8th group that takes 80 s, scaled
   down by `--tail-scale` (default 1/20: 0.5 s and 4 s). 8 groups of 8 fit the in-flight cap; a
   simulated learner takes complete groups from shellrl:episodes in completion order, 8 groups per
   step, bumps shellrl:policy:version and records each trajectory's staleness (learner version at
   training - oldest ACTION version). Batch-synchronous = max_staleness 0 (admit 8 groups, wait for
   the step); asynchronous = max_staleness k with the strict bound (default) and with DESIGN's
   plain bound. Slot utilisation = busy episode-seconds / (64 slots x window); trajectories/minute
   over the same window. (benchmarks/rollout_tail.py)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.rollout_tail import bench_tail
from services.rollout.agent_loop import AgentLoop
from services.rollout.episode_spec import EpisodeLimits, EpisodeSpec
from services.rollout.parts import connect_redis
from services.rollout.prompt import ChatFormat, load_chat_tokenizer
from shellrl import streams
from shellrl.clients.engine import EngineClient
from shellrl.clients.sandbox import SandboxClient
from shellrl.contract import min_policy_version, task_from_json
from shellrl.service.main import wait_until_ready
from tests.helpers.redis_server import RedisServer, free_port

console = Console(width=150)


# --- 1. gateway overhead ---------------------------------------------------------------------------


def _start(*commands: tuple[str, int, tuple[str, ...]]) -> list[subprocess.Popen]:
    """`python -m <module> --port <port> <extra>` for each (module, port, extra), started
    together; returns once every one answers /readyz (RuntimeError, all killed, when one fails)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, "--port", str(port), *extra],
            cwd=REPO,
            env={**os.environ, "SHELLRL_AUTH_DISABLED": "true"},  # the benchmark's own services
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for module, port, extra in commands
    ]
    try:
        for proc, (module, port, _) in zip(procs, commands, strict=True):
            wait_until_ready(
                f"http://127.0.0.1:{port}", START_DEADLINE_S, process=proc, what=module, poll_s=0.1
            )
    except RuntimeError:
        for proc in procs:
            proc.kill()
            proc.wait(10)
        raise
    return procs


START_DEADLINE_S = 180.0  # a fake service's start: its imports take seconds on 2 busy cores
REPLY = "<bash>true</bash>"  # every turn of the fake engine (+ end of turn)


@dataclass
class OverheadResult:
    transport: str
    concurrency: int
    turns_per_s: float
    pairs_per_s: float
    cpu_ms_per_turn: float
    cpu_ms_per_pair: float
    turn_latency_ms: float | None  # None: no turn finished in the single-episode run
    pair_latency_ms: float | None  # None: no pair finished in the single-pair run
    episodes: int = 0


NOT_MEASURED = "-"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None (not measured) when either is missing or the denominator
    is 0: a quick run's short window on a busy machine can end with no turn, pair or busy slot."""
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def cell(value: float | None, spec: str, suffix: str = "") -> str:
    """`value` formatted with `spec` (and `suffix`), or NOT_MEASURED for None."""
    return NOT_MEASURED if value is None else f"{value:{spec}}{suffix}"


def overhead_cells(r: OverheadResult) -> list[str]:
    """One row of the gateway-overhead table."""
    added = (
        None
        if r.turn_latency_ms is None or r.pair_latency_ms is None
        else r.turn_latency_ms - r.pair_latency_ms
    )
    return [
        r.transport,
        f"{r.turns_per_s:.0f}",
        f"{r.pairs_per_s:.0f}",
        cell(ratio(r.turns_per_s, r.pairs_per_s), ".2f"),
        f"{r.cpu_ms_per_turn:.2f}",
        f"{r.cpu_ms_per_pair:.2f}",
        f"{r.cpu_ms_per_turn - r.cpu_ms_per_pair:+.2f}",
        cell(r.turn_latency_ms, ".2f"),
        cell(r.pair_latency_ms, ".2f"),
        cell(added, "+.2f"),
    ]


def shipped_vs_before(shipped: OverheadResult, before: OverheadResult) -> str:
    """The line under the overhead table: the shipped transport against the one before."""
    return (
        f"shipped vs before: {cell(ratio(shipped.turns_per_s, before.turns_per_s), '.2f', 'x')} "
        f"turns/s, {cell(ratio(before.cpu_ms_per_turn, shipped.cpu_ms_per_turn), '.2f', 'x')} "
        "less gateway CPU per turn"
    )


TRANSPORTS = {
    "aiohttp (as shipped)": lambda: (
        None
    ),  # the clients' default: shellrl.clients.transport.AiohttpTransport
    "httpx's own (httpcore), before": lambda: httpx.AsyncHTTPTransport(
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=256)
    ),
}
"""HTTP transport under both clients: the shipped one, and httpx's own transport that the clients used
before (the baseline of the same run)."""


async def _bare_pairs(
    engine: EngineClient,
    sandbox: SandboxClient,
    prompt: list[int],
    concurrency: int,
    duration_s: float,
) -> tuple[float, float]:
    """(generate + exec pairs per second, CPU ms per pair) without the agent loop (the baseline)."""
    session = (await sandbox.create_session())["session_id"]
    count = 0
    stop_at = time.monotonic() + duration_s
    params = {"max_new_tokens": 40, "temperature": 1.0}

    async def loop() -> None:
        nonlocal count
        while time.monotonic() < stop_at:
            await engine.generate(prompt, params, return_logprob=True)
            await sandbox.exec(session, "true", timeout_s=5)
            count += 1

    cpu, start = time.process_time(), time.monotonic()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return count / (time.monotonic() - start), 1000 * (time.process_time() - cpu) / max(count, 1)


async def _agent_turns(
    agent: AgentLoop,
    producer: streams.StreamProducer,
    concurrency: int,
    duration_s: float,
    turns: int,
) -> tuple[float, float, int]:
    """(turns/s, gateway CPU ms per turn, episodes) with `concurrency` episodes running back to back."""
    task = task_from_json(
        {
            "task_id": "bench",
            "instruction": "Print the number of files in this directory.",
            "check": {"type": "answer_integer_equals", "expected": 0},
            "max_turns": turns,
        }
    )
    done_turns = episodes = 0
    stop_at = time.monotonic() + duration_s

    async def loop(worker: int) -> None:
        nonlocal done_turns, episodes
        n = 0
        while time.monotonic() < stop_at:
            traj = await agent.run(
                EpisodeSpec(task, f"bench-{worker}-{n}", group_id=f"g-{worker}", group_size=1)
            )
            await producer.add(
                traj.SerializeToString(),
                idempotency_key=traj.trajectory_id,
                task_id=traj.task_id,
                group_id=traj.group_id,
                version=min_policy_version(traj) or 0,
            )
            done_turns += traj.num_turns
            episodes += 1
            n += 1
            if traj.failure:
                failed.append(traj.failure_detail)

    failed: list[str] = []
    cpu, start = time.process_time(), time.monotonic()
    await asyncio.gather(*(loop(i) for i in range(concurrency)))
    wall, cpu = time.monotonic() - start, time.process_time() - cpu
    if failed and len(failed) == episodes:  # broken, not slow: each loop runs its first episode
        raise RuntimeError(f"every one of {episodes} episodes failed, e.g. {failed[0]!r}")
    return done_turns / wall, 1000 * cpu / max(done_turns, 1), episodes


async def bench_overhead(
    concurrency: int,
    duration_s: float,
    turns: int,
    transport: str = "aiohttp (as shipped)",
    single_s: float = 2.0,
) -> OverheadResult:
    """transport: a key of TRANSPORTS, used under both clients. `duration_s`: each concurrent run;
    `single_s`: each single-episode latency run (a warm-up of min(1, duration_s) s first)."""
    engine_port, sandbox_port = free_port(), free_port()
    redis_dir = tempfile.mkdtemp(prefix="bench-rollout-redis-")
    redis_server = RedisServer(Path(redis_dir)).start()
    chat = ChatFormat.from_tokenizer(load_chat_tokenizer("tiny"))
    reply = chat.tokenizer(REPLY, add_special_tokens=False)["input_ids"]
    reply_args = ("--reply-ids", ",".join(map(str, reply)))
    procs = _start(
        (
            "tests.fakes.fake_engine",
            engine_port,
            (*reply_args, "--end-of-turn-id", str(chat.end_of_turn_id)),
        ),
        ("tests.fakes.fake_sandbox", sandbox_port, ()),
    )
    try:
        redis = connect_redis(redis_server.url, concurrency + 32)
        producer = streams.StreamProducer(redis, streams.STREAM_EPISODES)
        async with (
            EngineClient(
                f"http://127.0.0.1:{engine_port}", transport=TRANSPORTS[transport]()
            ) as engine,
            SandboxClient(
                f"http://127.0.0.1:{sandbox_port}", transport=TRANSPORTS[transport]()
            ) as sandbox,
        ):
            agent = AgentLoop(
                engine, sandbox, chat, EpisodeLimits(max_turns=turns, max_context_tokens=8192)
            )
            prompt = chat.prompt_ids("Print the number of files in this directory.")
            # warm up connections and both servers
            await _bare_pairs(engine, sandbox, prompt, 4, min(1.0, duration_s))
            pairs_per_s, cpu_pair = await _bare_pairs(
                engine, sandbox, prompt, concurrency, duration_s
            )
            turns_per_s, cpu_ms, episodes = await _agent_turns(
                agent, producer, concurrency, duration_s, turns
            )
            one_pair, _ = await _bare_pairs(engine, sandbox, prompt, 1, single_s)
            one_turns, _, _ = await _agent_turns(agent, producer, 1, single_s, turns)
        await redis.aclose()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        redis_server.stop()
    return OverheadResult(
        transport,
        concurrency,
        turns_per_s,
        pairs_per_s,
        cpu_ms,
        cpu_pair,
        ratio(1000, one_turns),
        ratio(1000, one_pair),
        episodes,
    )


# --- report ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_rollout", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--turns", type=int, default=8, help="turns per overhead episode")
    parser.add_argument(
        "--duration-s", type=float, default=10.0, help="measuring time of each overhead run"
    )
    parser.add_argument(
        "--tail-scale", type=float, default=0.05, help="10 s / 80 s episodes times this"
    )
    parser.add_argument(
        "--tail-window-s", type=float, default=40.0, help="measuring window of each tail mode"
    )
    parser.add_argument("--async-staleness", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="32 episodes x 4 turns for 1 s per run; tail episodes 0.1 s / 0.8 s in 3 s windows, "
        "k=2 only (a smoke run: seconds)",
    )
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--skip-tail", action="store_true")
    args = parser.parse_args(argv)
    single_s = 2.0
    if args.quick:
        args.concurrency, args.turns, args.duration_s, single_s = 32, 4, 1.0, 0.5
        args.tail_scale, args.tail_window_s, args.async_staleness = 0.01, 3.0, [2]
    console.print(f"[bold]Rollout gateway[/bold] on {os.cpu_count()} CPU cores")

    if not args.skip_overhead:
        rows = [
            asyncio.run(bench_overhead(args.concurrency, args.duration_s, args.turns, t, single_s))
            for t in TRANSPORTS
        ]
        table = Table(
            title=f"Gateway overhead: zero-latency FAKE engine and sandbox processes, {args.concurrency} "
            f"concurrent episodes x {args.turns} turns; baseline = bare generate+exec pairs, same "
            "clients, same concurrency"
        )
        for col in (
            "HTTP transport",
            "turns/s",
            "pairs/s",
            "ratio",
            "CPU ms/turn",
            "CPU ms/pair",
            "agent-loop CPU ms/turn",
            "latency ms/turn (1 episode)",
            "ms/pair (1)",
            "added ms/turn",
        ):
            table.add_column(col, justify="right")
        for r in rows:
            table.add_row(*overhead_cells(r))
        console.print(table)
        console.print(shipped_vs_before(rows[0], rows[1]))

    if not args.skip_tail:
        modes = [("batch-synchronous", 0, True)]
        modes += [(f"async strict k={k}", k, True) for k in args.async_staleness]
        modes += [(f"async plain k={k}", k, False) for k in args.async_staleness[:1]]
        results = [
            asyncio.run(
                bench_tail(name, k, strict, scale=args.tail_scale, window_s=args.tail_window_s)
            )
            for name, k, strict in modes
        ]
        base = results[0]
        table = Table(
            title=f"Long tail: 8 groups x 8 in flight, episodes {10 * args.tail_scale:g} s, one per 8 groups "
            f"{80 * args.tail_scale:g} s (10 s / 80 s x {args.tail_scale:g}); window {args.tail_window_s:g} s"
        )
        for col in (
            "admission",
            "slot utilisation",
            "vs sync",
            "trajectories/min",
            "learner steps",
            "max staleness",
            "trained > max_staleness",
        ):
            table.add_column(col, justify="right")
        for r in results:
            table.add_row(
                r.mode,
                f"{100 * r.utilisation:.1f}%",
                cell(ratio(r.utilisation, base.utilisation), ".2f", "x"),
                f"{r.trajectories_per_min:.0f}",
                str(r.steps),
                str(r.max_staleness_seen),
                f"{r.over_bound} of {r.trained}",
            )
        console.print(table)


if __name__ == "__main__":
    main()
