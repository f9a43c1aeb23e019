"""The learner's weight push into a CPU engine that is generating, by pause mode (issue 30 item 6):
`python -m benchmarks.bench_push_under_load [--model smollm2] [--streams 8] [--blocks 3]
[--rows standalone,in_place] [--quick]` (`--quick`: the tiny test model, 2 streams, 1 block of 2
pushes).

The main job's timing.json on CPU: 41 pushes, mean 1,932 ms, of which `load` 1,690 ms, against
78-117 ms for the same shm push standalone. `load` is the engine's session end, and shellrl's
engine commits a session only between two steps once no request is running (services/engine
runtime._commit, when_idle), so an unpaused push waits for every generation in flight to end
while new ones are held back. Paused (in_place or retract) the commit runs at once.

One real `python -m services.engine` process; this process is the learner (its real WeightSync,
shm with the parameters in the kept segment, the learner's default) and the rollout's load:
`--streams` loops each calling /generate back to back with a `--prompt-tokens` prompt and
`--new-tokens` new tokens (the main job: prompts of ~360 tokens, 40 new tokens a turn, 8 episodes
of a group at once). Rows, in blocks of `--pushes` pushes interleaved `--blocks` times (load on a
shared machine hits all alike): standalone (no generation), then under load with pause off (the
engine's `auto` before this change), in_place and retract. Per row: push total and `load`
(median, p90), the engine's sampled tokens/s during the row's blocks (its
shellrl_engine_generation_tokens_total; a retracted request's tokens are sampled once) and
push / standalone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
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

from benchmarks.bench_engine import start_engine  # noqa: E402
from shellrl.clients.engine import EngineClient  # noqa: E402

console = Console()
ROWS = ("standalone", "off", "in_place", "retract")


class Load:
    """`streams` generate loops against the engine; `running` switches them on and off (a loop
    finishes its call, then waits)."""

    def __init__(self, client: EngineClient, streams: int, prompt_tokens: int, new_tokens: int):
        self.client, self.running = client, asyncio.Event()
        rng = random.Random(0)
        self.prompts = [
            [rng.randrange(200, 40000) for _ in range(prompt_tokens)] for _ in range(streams)
        ]
        self.params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
        self.tasks = [asyncio.ensure_future(self._loop(p)) for p in self.prompts]

    async def _loop(self, prompt: list[int]) -> None:
        while True:
            await self.running.wait()
            await self.client.generate(prompt, self.params)

    async def idle(self, deadline_s: float = 300.0) -> None:
        """Stop the loops and wait until nothing of theirs runs; TimeoutError after `deadline_s`
        seconds (an engine whose requests never finish)."""
        self.running.clear()
        deadline = time.monotonic() + deadline_s
        while True:
            info = next(iter((await self.client.get_server_info()).values()))
            state = info["internal_states"][0]
            if not state["num_running_reqs"] and not state["num_waiting_reqs"]:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the engine still runs requests after {deadline_s:g} s: {state}"
                )
            await asyncio.sleep(0.05)  # poll period of the condition above

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()


async def generated_tokens(url: str) -> float:
    """The engine's shellrl_engine_generation_tokens_total (every sampled token, calls in flight
    included)."""
    import httpx

    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{url}/metrics")).text
    for line in text.splitlines():
        if line.startswith("shellrl_engine_generation_tokens_total "):
            return float(line.split()[1])
    return 0.0


async def bench(url: str, args) -> Table:
    import torch

    from services.learner.weights.weight_sync import WeightSync
    from shellrl.models import load_model

    model = load_model(args.model)
    rows = args.rows
    pushes: dict[str, list[dict]] = {row: [] for row in rows}
    rates: dict[str, list[float]] = {row: [] for row in rows}
    version = 0
    with tempfile.TemporaryDirectory() as sync_dir:
        async with EngineClient([url], timeout_s=600) as client:
            sync = WeightSync(
                client, None, transport="shm", deadline_s=600, sync_dir=sync_dir,
                share_parameters=True,
            )  # fmt: skip
            load = Load(client, args.streams, args.prompt_tokens, args.new_tokens)
            try:
                for _ in range(2):  # warm-up: the kept segment, the engine's arenas
                    version += 1
                    await sync.push(model, version)
                for _ in range(args.blocks):
                    for row in rows:
                        if row == "standalone":
                            await load.idle()
                        else:
                            load.running.set()
                            await asyncio.sleep(1.0)  # the loops reach a steady batch
                        sync.pause_mode = "off" if row == "standalone" else row
                        tokens0, t0 = await generated_tokens(url), time.perf_counter()
                        for _ in range(args.pushes):
                            with torch.no_grad():  # an optimizer step, in place
                                for p in model.parameters():
                                    p.add_(1e-4)
                            version += 1
                            result = await sync.push(model, version)
                            assert result.confirmed == (url,), result.failed
                            pushes[row].append(result.phases)
                            await asyncio.sleep(args.gap_s)
                        tokens = await generated_tokens(url) - tokens0
                        rates[row].append(tokens / (time.perf_counter() - t0))
            finally:
                load.close()
                sync.close()
    return _table(pushes, rates, args)


def _ms(values: list[float], q: float) -> float:
    values = sorted(values)
    return 1000 * values[min(len(values) - 1, int(q * len(values)))]


def _table(pushes: dict, rates: dict, args) -> Table:
    table = Table(
        title=f"Weight push while the engine generates ({args.model}, shm, {args.streams} streams "
        f"of {args.prompt_tokens}-token prompts and {args.new_tokens} new tokens; "
        f"{args.pushes} pushes x {args.blocks} blocks, interleaved)"
    )
    for column in (
        "row",
        "push ms p50",
        "push ms p90",
        "load ms p50",
        "load ms p90",
        "engine tokens/s",
        "push / standalone",
    ):
        table.add_column(column, justify="right")
    base = statistics.median(p["total"] for p in pushes["standalone"])
    for row in pushes:
        totals = [p["total"] for p in pushes[row]]
        loads = [p.get("load", 0.0) for p in pushes[row]]
        table.add_row(
            row,
            f"{_ms(totals, 0.5):.1f}",
            f"{_ms(totals, 0.9):.1f}",
            f"{_ms(loads, 0.5):.1f}",
            f"{_ms(loads, 0.9):.1f}",
            "-" if row == "standalone" else f"{statistics.median(rates[row]):.1f}",
            f"{statistics.median(totals) / base:.2f}x",
        )
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_push_under_load", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny or a HF directory")
    parser.add_argument("--threads", type=int, default=1, help="engine torch threads")
    parser.add_argument("--streams", type=int, default=8, help="generate loops at once")
    parser.add_argument("--prompt-tokens", type=int, default=360)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--pushes", type=int, default=4, help="pushes per row per block")
    parser.add_argument("--blocks", type=int, default=3, help="rounds over the rows")
    parser.add_argument("--gap-s", type=float, default=0.5, help="seconds between two pushes")
    parser.add_argument(
        "--rows",
        default=",".join(ROWS),
        help=f"comma-separated rows of {', '.join(ROWS)} (standalone, the baseline, always runs "
        "first); off takes tens of seconds a push under load",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, 2 streams, 1 block of 2 pushes"
    )
    args = parser.parse_args(argv)
    asked = [r.strip() for r in args.rows.split(",") if r.strip()]
    if unknown := sorted(set(asked) - set(ROWS)):
        parser.error(f"--rows: unknown {unknown}; rows are {', '.join(ROWS)}")
    args.rows = ["standalone", *(r for r in ROWS if r in asked and r != "standalone")]
    if args.quick:
        args.model, args.streams, args.blocks, args.pushes, args.gap_s = "tiny", 2, 1, 2, 0.1
        args.prompt_tokens = 64
    console.print(
        f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
        f"engine threads: {args.threads}"
    )
    with tempfile.TemporaryDirectory() as logs:
        engine = start_engine(Path(logs), args.threads, model=args.model)
        try:
            console.print(asyncio.run(bench(engine.url, args)))
        finally:
            engine.stop()
    console.print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
