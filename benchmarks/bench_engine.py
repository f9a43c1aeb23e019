"""Engine benchmarks (issue 4): `python -m benchmarks.bench_engine [--quick] [--threads N]`
(`--quick`: the tiny test model, fewer levels, requests and pushes: a smoke run of seconds).

Every measurement goes through a real `python -m services.engine` process with SmolLM2-135M-Instruct
and the real `EngineClient` over HTTP; each table compares against a baseline of the same run.

1. Batching: output tokens/s with 1, 4, 8 and 16 concurrent requests (distinct 64-token prompts,
   32 new tokens each, T = 1, EOS ignored), levels interleaved over `--rounds` rounds. Baseline:
   1 request at a time.
2. Prefix cache: 32 concurrent episode-like requests sharing a 300-token prefix (plus a distinct
   20-token suffix, 16 new tokens), with the prefix cache against an engine started with
   `--disable-radix-cache`.
3. Weight update of the whole model, learner view end to end (tensors in memory -> engine reports
   the new version): flattened bucket in shared memory through `/update_weights_from_tensor`
   (inside begin/end_weight_update), with a segment kept and refilled by every push and with a new
   segment per push, against a safetensors directory through `/update_weights_from_disk`
   (write + load). Two warm-up pushes first (the engine allocates its staging arenas once).
   Median of `--repeats`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from shellrl.clients.engine import EngineClient  # noqa: E402
from tests.helpers.processes import ServiceProcess  # noqa: E402
from tests.helpers.redis_server import free_port  # noqa: E402

console = Console()


def start_engine(log_dir: Path, threads: int, *args: str, model: str = "smollm2") -> ServiceProcess:
    env = {
        "SHELLRL_MODEL_PATH": model,
        "SHELLRL_LOG_LEVEL": "WARNING",
        "SHELLRL_NUM_THREADS": str(threads),
    }
    return ServiceProcess("engine", free_port(), env, log_dir, args=list(args)).start(
        ready_timeout_s=300
    )


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


async def _wave(client: EngineClient, prompts: list[list[int]], params: dict) -> tuple[int, float]:
    start = time.perf_counter()
    results = await asyncio.gather(*(client.generate(p, params) for p in prompts))
    return sum(len(r.output_ids) for r in results), time.perf_counter() - start


async def bench_batching(
    url: str, levels: list[int], new_tokens: int, rounds: int, model: str = "smollm2"
) -> Table:
    """Levels interleaved over `rounds` rounds (a noisy shared machine hits all levels alike)."""
    rng = random.Random(0)
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    rates: dict[int, list[float]] = {level: [] for level in levels}
    async with EngineClient([url], timeout_s=1800) as client:
        await _wave(client, [_prompt(rng, 64)], {**params, "max_new_tokens": 4})  # warm-up
        for _ in range(rounds):
            for level in levels:
                tokens, wall = await _wave(client, [_prompt(rng, 64) for _ in range(level)], params)
                rates[level].append(tokens / wall)
    table = Table(
        title=f"Engine batching: output tokens/s ({model}, 64-token prompts, {new_tokens} new "
        f"tokens, median and best of {rounds} interleaved rounds)"
    )
    for column in (
        "concurrent requests",
        "tokens/s (median)",
        "tokens/s (best)",
        "median vs 1 request",
    ):
        table.add_column(column, justify="right")
    base = statistics.median(rates[levels[0]])
    for level in levels:
        median = statistics.median(rates[level])
        table.add_row(
            str(level), f"{median:.1f}", f"{max(rates[level]):.1f}", f"{median / base:.2f}x"
        )
    return table


async def _episodes(url: str, requests: int) -> float:
    """Wall seconds of `requests` concurrent requests sharing a 300-token prefix."""
    rng = random.Random(1)
    shared = _prompt(rng, 300)
    prompts = [shared + _prompt(rng, 20) for _ in range(requests)]
    async with EngineClient([url], timeout_s=1800) as client:
        await _wave(client, [_prompt(rng, 8)], {"max_new_tokens": 2})  # warm-up, unrelated prefix
        _, wall = await _wave(
            client, prompts, {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
        )
    return wall


async def bench_weight_update(url: str, repeats: int, model: str = "smollm2") -> Table:
    """Each transport's pushes run back to back, after one warm-up push of its own, as one learner's
    would (the engine keeps the last segment it mapped, so interleaving transports would measure a
    mapping per push that no learner pays)."""
    import torch

    from shellrl.models import load_model
    from shellrl.weights import disk as wtd
    from shellrl.weights import shm

    named = [(n, p.detach().clone()) for n, p in load_model(model).named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    times: dict[str, list[float]] = {
        "kept": [],
        "adopted": [],
        "fresh": [],
        "disk": [],
        "durable": [],
    }
    scratch = tempfile.mkdtemp(prefix="bench-engine-")
    counter = iter(range(10**6))

    params: list = []  # the adopted row's parameters (made below)

    def new_version() -> None:
        """An optimizer step, in place and outside the timed span: the learner's tensors and the
        adopted parameters (which live in their segment)."""
        with torch.no_grad():
            for t in [t for _, t in named] + [p for _, p in params]:
                t.add_(1e-4)

    async def timed(name: str, push) -> None:
        for i in range(repeats + 1):  # the first: warm-up (arenas, the mapping of a new segment)
            new_version()
            start = time.perf_counter()
            version = f"{name}-{next(counter)}"
            await push(version)
            assert (await client.get_weight_version())[url] == version
            if i:
                times[name].append(time.perf_counter() - start)

    async with EngineClient([url], timeout_s=600) as client:
        kept = shm.SharedMemoryBucket(named)  # the learner's segment, refilled by every push
        # the learner service's default on CPU (SHELLRL_SHM_SHARE_PARAMETERS): its parameters live in the
        # kept segment, the optimizer writes there, a push copies nothing on the learner side
        params += [(n, torch.nn.Parameter(t.clone())) for n, t in named]
        adopted = shm.SharedMemoryBucket([(n, p.detach()) for n, p in params])
        adopted.adopt([p for _, p in params])

        async def push_kept(version: str) -> None:
            await client.update_weights_from_tensor(
                [kept.refill(named).payload()], weight_version=version
            )

        async def push_adopted(
            version: str,
        ) -> None:  # new_version stepped the parameters in the segment
            await client.update_weights_from_tensor(
                [adopted.refill([(n, p.detach()) for n, p in params]).payload()],
                weight_version=version,
            )

        async def push_fresh(version: str) -> None:
            with shm.SharedMemoryBucket(named) as bucket:
                await client.update_weights_from_tensor([bucket.payload()], weight_version=version)

        async def push_disk(version: str, durable: bool = False) -> None:
            directory = Path(scratch) / version
            path = wtd.save_safetensors_dir(named, directory)
            if durable:  # the same, made durable first (shared storage across hosts)
                descriptor = os.open(path, os.O_RDONLY)
                os.fsync(descriptor)
                os.close(descriptor)
            await client.update_weights_from_disk(str(directory), version)
            shutil.rmtree(directory)

        async def push_durable(version: str) -> None:
            await push_disk(version, durable=True)

        try:
            await timed("disk", push_disk)
            await timed("durable", push_durable)
            await timed("fresh", push_fresh)
            await timed("kept", push_kept)
            await timed("adopted", push_adopted)
        finally:
            kept.close()
            adopted.close()
            shutil.rmtree(scratch, ignore_errors=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    table = Table(
        title=f"Whole-model weight update, learner memory to live weights ({nbytes / 2**20:.0f} MiB "
        f"float32, median of {repeats})"
    )
    for column in ("transport", "seconds", "vs disk"):
        table.add_column(column, justify="right")
    table.add_row(
        "safetensors on disk: write + /update_weights_from_disk", f"{median['disk']:.3f}", "1.00x"
    )
    table.add_row(
        "safetensors on disk, fsync'd before the call",
        f"{median['durable']:.3f}",
        f"{median['disk'] / median['durable']:.2f}x faster",
    )
    table.add_row(
        "shared memory, new segment per push: /update_weights_from_tensor",
        f"{median['fresh']:.3f}",
        f"{median['disk'] / median['fresh']:.2f}x faster",
    )
    table.add_row(
        "shared memory, kept segment (refill): /update_weights_from_tensor",
        f"{median['kept']:.3f}",
        f"{median['disk'] / median['kept']:.2f}x faster",
    )
    table.add_row(
        "shared memory, parameters live in the segment (adopt): /update_weights_from_tensor",
        f"{median['adopted']:.3f}",
        f"{median['disk'] / median['adopted']:.2f}x faster",
    )
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_engine", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the tiny test model, 1 and 4 requests of 8 tokens, 8 prefix requests, 1 push "
        "(a smoke run: seconds)",
    )
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny or a HF directory")
    parser.add_argument(
        "--threads", type=int, default=0, help="engine torch threads (0: torch's default)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="weight updates per transport")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the batching levels")
    parser.add_argument("--only", choices=("batching", "prefix", "weights"), action="append")
    args = parser.parse_args(argv)
    parts = args.only or ["batching", "prefix", "weights"]
    new_tokens, levels, prefix_requests = 32, [1, 4, 8, 16], 32
    repeats, rounds = args.repeats, args.rounds
    if args.quick:
        args.model, new_tokens, levels, prefix_requests, repeats, rounds = (
            "tiny",
            8,
            [1, 4],
            8,
            1,
            1,
        )
    console.print(
        f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
        f"engine threads: {args.threads or 'torch default'}"
    )
    with tempfile.TemporaryDirectory() as logs, ThreadPoolExecutor(1) as pool:
        start_uncached = functools.partial(
            start_engine, Path(logs), args.threads, "--disable-radix-cache", model=args.model
        )
        # a smoke run starts the engine without prefix cache while the first one is measured
        uncached = pool.submit(start_uncached) if args.quick and "prefix" in parts else None
        try:
            engine = start_engine(Path(logs), args.threads, model=args.model)
            try:
                if "batching" in parts:
                    console.print(
                        asyncio.run(
                            bench_batching(engine.url, levels, new_tokens, rounds, model=args.model)
                        )
                    )
                if "prefix" in parts:
                    with_cache = asyncio.run(_episodes(engine.url, prefix_requests))
                if "weights" in parts:
                    console.print(
                        asyncio.run(bench_weight_update(engine.url, repeats, model=args.model))
                    )
            finally:
                engine.stop()
        except BaseException:
            if uncached is not None:
                uncached.result().stop()
            raise
        if "prefix" in parts:
            engine = uncached.result() if uncached is not None else start_uncached()
            try:
                without_cache = asyncio.run(_episodes(engine.url, prefix_requests))
            finally:
                engine.stop()
            table = Table(
                title=f"{prefix_requests} episode-like requests sharing a 300-token prefix "
                "(+20 own tokens, 16 new tokens)"
            )
            for column in ("engine", "wall s", "speed-up"):
                table.add_column(column, justify="right")
            table.add_row(
                "without prefix cache (--disable-radix-cache)", f"{without_cache:.1f}", "1.00x"
            )
            table.add_row(
                "with prefix cache", f"{with_cache:.1f}", f"{without_cache / with_cache:.2f}x"
            )
            console.print(table)
    console.print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
