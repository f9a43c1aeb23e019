"""Where the agent loop's CPU per turn goes (issue 37 item 4):
`python -m benchmarks.rollout_profile [--quick]`.

The gateway-overhead section of bench_rollout (the real `AgentLoop`, `EngineClient`,
`SandboxClient` and Redis producer against the zero-latency fake engine and sandbox processes), with
cProfile on for two phases of one run: bare generate + exec pairs, then agent-loop episodes, at the
same concurrency. Prints, for each phase, the top functions by own time in microseconds per turn
(per pair), and the functions whose own time per turn grew most from the pairs to the turns: the
price of the agent loop, function by function. cProfile's own cost inflates every number (about 2x
on this VM); the shares and the ranking are what it is for. Not part of `make bench`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.bench_rollout import REPLY, _agent_turns, _bare_pairs, _start
from services.rollout.agent_loop import AgentLoop
from services.rollout.episode_spec import EpisodeLimits
from services.rollout.parts import connect_redis
from services.rollout.prompt import ChatFormat, load_chat_tokenizer
from shellrl import streams
from shellrl.clients.engine import EngineClient
from shellrl.clients.sandbox import SandboxClient
from tests.helpers.redis_server import RedisServer, free_port

Key = tuple[str, int, str]  # pstats' (file, line, function)


@contextlib.contextmanager
def cprofiled(name: str) -> Iterator[dict[Key, float]]:
    """cProfile on this thread, timed by CPU time (a busy VM's wall clock would charge other
    processes' slices to whatever ran); yields a dict filled on exit: own seconds by function."""
    own: dict[Key, float] = {}
    profile = cProfile.Profile(time.process_time)
    profile.enable()
    try:
        yield own
    finally:
        profile.disable()
        for key, row in pstats.Stats(profile).stats.items():  # (cc, nc, tottime, cumtime, callers)
            own[key] = row[2]


def py_spied(py_spy: str, rate_hz: int = 200) -> Callable:
    """`py-spy record` attached to this process for the phase (samples only while on a CPU, so
    about 1/rate_hz of CPU per sample, and without cProfile's cost per call); own seconds by
    function = the event loop thread's samples whose innermost frame is that function / rate_hz."""

    @contextlib.contextmanager
    def profiler(name: str) -> Iterator[dict[Key, float]]:
        own: dict[Key, float] = {}
        out = Path(tempfile.mkdtemp(prefix="rollout-py-spy-")) / f"{name}.txt"
        command = [py_spy, "record", "--pid", str(os.getpid()), "-r", str(rate_hz), "-f", "raw"]
        command.append("--nonblocking")  # never pauses this process to sample it
        spy = subprocess.Popen(
            [*command, "-o", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(1.0)  # attached
        try:
            yield own
        finally:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            spy.wait(30)
            own.update(read_raw(out.read_text(), rate_hz))

    return profiler


def read_raw(raw: str, rate_hz: int) -> dict[Key, float]:
    """Own seconds by function from py-spy's raw (collapsed) output, one line a stack,
    `frame;frame;... count` with each frame `function (path:line)`, outermost first. Only the
    event loop's thread counts (a stack through `BaseEventLoop._run_once`)."""
    own: dict[Key, float] = {}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if "._run_once (" not in stack:
            continue  # not the event loop's thread (e.g. a test helper's)
        function, _, where = stack.rpartition(";")[2].rpartition(" (")
        key = (where.rstrip(")").rpartition(":")[0], 0, function)  # py-spy names the line running
        own[key] = own.get(key, 0.0) + int(count) / rate_hz
    return own


@dataclass
class Phase:
    """One profiled phase: the profiler's own seconds by function, the pairs or turns done, and
    the process's CPU seconds over the phase (profiler included)."""

    own_s: dict[Key, float]
    count: int
    cpu_s: float

    def per_unit_us(self, cpu_us_per_unit: float) -> dict[Key, float]:
        """Own time by function in microseconds per pair or turn: each function's share of the
        profile times `cpu_us_per_unit` (the unprofiled CPU per unit, measured separately; the
        profiler's own cost would otherwise inflate every function)."""
        total = sum(self.own_s.values()) or 1.0
        return {key: cpu_us_per_unit * s / total for key, s in self.own_s.items()}


def label(key: Key) -> str:
    path, line, name = key
    if path == "~":
        return name  # a builtin or a module: "<method 'encode' of 'str' objects>"
    parts = Path(path).parts
    short = "/".join(
        parts[parts.index("site-packages") + 1 :] if "site-packages" in parts else parts[-3:]
    )
    return f"{short}:{line}({name})" if line else f"{short}({name})"


PROJECT = {"services", "shellrl", "benchmarks", "tests", "cli", "tasksets"}


def module_of(key: Key) -> str:
    """The package of a site-packages file (`aiohttp`), the repo path of a project file
    (`services/rollout/prompt.py`), the stdlib module (`asyncio`), or `builtins`."""
    path = key[0]
    if path == "~":
        return "builtins"
    parts = Path(path).parts
    if "site-packages" in parts:
        return parts[parts.index("site-packages") + 1]
    for i, part in enumerate(parts):
        if part in PROJECT and (REPO / Path(*parts[i:])).exists():
            return "/".join(parts[i:])
    name = Path(path).name
    for folder in reversed(parts[:-1]):
        if folder.startswith("python3"):
            break
        name = f"{folder}/{name}"
    return name.split("/")[0].removesuffix(".py")


CATEGORIES = (
    # (what the time pays for, modules, functions (any when empty))
    ("version spans", ("services/rollout/agent_loop.py",), ("_append_action", "parse_version")),
    (
        "token bookkeeping (tokenize observation, decode + parse action, segments)",
        (
            "services/rollout/prompt.py",
            "services/rollout/actions.py",
            "shellrl/contract/trajectory.py",
        ),
        (),
    ),
    ("durability (XADD of the trajectory)", ("redis", "shellrl/streams/producer.py"), ()),
    ("metrics", ("prometheus_client",), ()),
    (
        "agent loop's own control flow",
        ("services/rollout/agent_loop.py", "services/rollout/engine_pin.py"),
        (),
    ),
)


def category_of(key: Key) -> str:
    module, name = module_of(key), key[2]
    for category, modules, functions in CATEGORIES:
        if module in modules and (not functions or any(f in name for f in functions)):
            return category
    return "HTTP and the event loop (clients, aiohttp, httpx, asyncio, ...)"


def grouped(rows: dict[Key, float], group: Callable[[Key], str]) -> dict[Key, float]:
    out: dict[Key, float] = {}
    for key, us in rows.items():
        name = ("~", 0, group(key))
        out[name] = out.get(name, 0.0) + us
    return out


def print_top(title: str, rows: dict[Key, float], top: int) -> None:
    """The `top` largest rows with their share of the total ("-": a total of 0, as a short
    phase's differences can sum to, has no shares)."""
    total = sum(rows.values())
    print(f"\n{title}: {total:.0f} us of own time in all")
    print(f"{'us':>8} {'share':>6}  function")
    for key, us in sorted(rows.items(), key=lambda kv: -kv[1])[:top]:
        share = f"{100 * us / total:5.1f}%" if total else f"{'-':>6}"
        print(f"{us:8.1f} {share}  {label(key)}")


async def profile_phases(
    concurrency: int, duration_s: float, turns: int, profiler: Callable
) -> tuple[Phase, Phase]:
    """(bare pairs, agent-loop turns), each phase under `profiler(name)` (`cprofiled` or
    `py_spied`), against the fake processes."""
    engine_port, sandbox_port = free_port(), free_port()
    redis_server = RedisServer(Path(tempfile.mkdtemp(prefix="profile-rollout-redis-"))).start()
    chat = ChatFormat.from_tokenizer(load_chat_tokenizer("tiny"))
    reply = chat.tokenizer(REPLY, add_special_tokens=False)["input_ids"]
    procs = _start(
        (
            "tests.fakes.fake_engine",
            engine_port,
            (
                "--reply-ids",
                ",".join(map(str, reply)),
                "--end-of-turn-id",
                str(chat.end_of_turn_id),
            ),
        ),
        ("tests.fakes.fake_sandbox", sandbox_port, ()),
    )
    try:
        redis = connect_redis(redis_server.url, concurrency + 32)
        producer = streams.StreamProducer(redis, streams.STREAM_EPISODES)
        async with (
            EngineClient(f"http://127.0.0.1:{engine_port}") as engine,
            SandboxClient(f"http://127.0.0.1:{sandbox_port}") as sandbox,
        ):
            agent = AgentLoop(
                engine, sandbox, chat, EpisodeLimits(max_turns=turns, max_context_tokens=8192)
            )
            prompt = chat.prompt_ids("Print the number of files in this directory.")
            await _bare_pairs(engine, sandbox, prompt, 4, 1.0)  # warm up
            await _agent_turns(agent, producer, 4, 1.0, turns)
            with profiler("pairs") as pair_s:
                start, cpu = time.monotonic(), time.process_time()
                rate, _ = await _bare_pairs(engine, sandbox, prompt, concurrency, duration_s)
                pairs = Phase(pair_s, round(rate * (time.monotonic() - start)), 0.0)
                pairs.cpu_s = time.process_time() - cpu
            with profiler("turns") as turn_s:
                start, cpu = time.monotonic(), time.process_time()
                rate, _, _ = await _agent_turns(agent, producer, concurrency, duration_s, turns)
                done_turns = Phase(turn_s, round(rate * (time.monotonic() - start)), 0.0)
                done_turns.cpu_s = time.process_time() - cpu
        await redis.aclose()
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        redis_server.stop()
    return pairs, done_turns


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rollout_profile", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--turns", type=int, default=8, help="turns per episode")
    parser.add_argument("--duration-s", type=float, default=20.0, help="each profiled phase")
    parser.add_argument("--rate-hz", type=int, default=400, help="py-spy's samples per second")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument(
        "--cpu-ms-per-pair",
        type=float,
        help="gateway CPU per bare pair to share out (default: the profiled phase's own, right for "
        "py-spy; for cProfile give bench_rollout's unprofiled 'CPU ms/pair')",
    )
    parser.add_argument(
        "--cpu-ms-per-turn",
        type=float,
        help="gateway CPU per turn to share out (default: the profiled phase's own)",
    )
    parser.add_argument(
        "--py-spy", metavar="PATH", help="sample with this py-spy binary instead of cProfile"
    )
    parser.add_argument("--quick", action="store_true", help="32 episodes x 4 turns, 1 s phases")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.turns, args.duration_s = 32, 4, 1.0
    profiler = py_spied(args.py_spy, args.rate_hz) if args.py_spy else cprofiled
    pairs, turns = asyncio.run(
        profile_phases(args.concurrency, args.duration_s, args.turns, profiler)
    )
    pair_ms = args.cpu_ms_per_pair or 1e3 * pairs.cpu_s / max(pairs.count, 1)
    turn_ms = args.cpu_ms_per_turn or 1e3 * turns.cpu_s / max(turns.count, 1)
    print(
        f"profiled: {pairs.count} pairs, {1e3 * pairs.cpu_s / max(pairs.count, 1):.2f} ms CPU/pair; "
        f"{turns.count} turns, {1e3 * turns.cpu_s / max(turns.count, 1):.2f} ms CPU/turn; "
        f"the tables share {pair_ms:.2f} ms/pair and {turn_ms:.2f} ms/turn out by profile"
    )
    per_pair, per_turn = pairs.per_unit_us(1e3 * pair_ms), turns.per_unit_us(1e3 * turn_ms)
    print_top(f"bare pairs: own CPU per pair ({pairs.count} pairs)", per_pair, args.top)
    print_top(f"agent loop: own CPU per turn ({turns.count} turns)", per_turn, args.top)
    added = {key: per_turn.get(key, 0.0) - per_pair.get(key, 0.0) for key in per_turn | per_pair}
    print_top("added per turn (turn - pair), largest", added, args.top)
    print_top("added per turn, by module", grouped(added, module_of), args.top)
    print_top("added per turn, by what it pays for", grouped(added, category_of), args.top)


if __name__ == "__main__":
    main()
