"""HTTP round trip of a FastAPI service under uvicorn: h11 vs httptools (vs uvloop), one run.

Every service call in shellrl (generate, exec, weight updates) pays one of these. A FastAPI app with
`GET /healthz` runs in a subprocess per server configuration; one keep-alive httpx client sends
`--requests` sequential requests; the median round trip after 50 warm-up requests is reported, each
configuration `--rounds` times interleaved, with the ratio to h11 (uvicorn's pure-Python parser) of
the same round. shellrl's services run with uvicorn's default choice, which is httptools when it is
installed (a dependency since 2026-11-30); uvloop is not a dependency.

Run: `python -m benchmarks http` (`--quick`: 50 requests, 1 round).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import subprocess
import sys
import time

import httpx
from rich.console import Console
from rich.table import Table

SERVER = """
import sys, uvicorn
from fastapi import FastAPI
app = FastAPI()
@app.get("/healthz")
async def healthz():
    return {"ok": True}
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop=sys.argv[2], http=sys.argv[3],
            log_level="warning", access_log=False)
"""


START_DEADLINE_S = 120.0  # a server's first answer: imports take seconds on 2 busy cores


async def wait_serving(
    client: httpx.AsyncClient, url: str, proc: subprocess.Popen, deadline_s: float
) -> None:
    """Until GET `url` answers; RuntimeError as soon as `proc` (the server) has exited,
    TimeoutError after `deadline_s` seconds."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            await client.get(url)
            return
        except httpx.TransportError:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} before it answered")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer from {url} within {deadline_s:g} s") from None
            await asyncio.sleep(0.05)  # poll period of the condition above


async def _median_rtt_ms(port: int, requests: int, proc: subprocess.Popen) -> float:
    async with httpx.AsyncClient() as client:
        url = f"http://127.0.0.1:{port}/healthz"
        await wait_serving(client, url, proc, START_DEADLINE_S)
        samples = []
        for _ in range(requests + 50):
            t0 = time.perf_counter()
            (await client.get(f"http://127.0.0.1:{port}/healthz")).raise_for_status()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples[50:]) * 1e3


def main(argv: list[str] | None = None) -> None:
    from tests.helpers.redis_server import free_port

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks http", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--quick", action="store_true", help="50 requests, 1 round (a smoke run: seconds)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.rounds = 50, 1
    configs = [("asyncio", "h11"), ("asyncio", "httptools")]
    if importlib.util.find_spec("uvloop"):
        configs.append(("uvloop", "httptools"))
    results: dict[tuple[str, str], list[float]] = {c: [] for c in configs}
    for _ in range(args.rounds):
        for loop, http in configs:
            port = free_port()
            proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), loop, http])
            try:
                results[(loop, http)].append(asyncio.run(_median_rtt_ms(port, args.requests, proc)))
            finally:
                proc.terminate()
                proc.wait(timeout=10)
    table = Table(
        title=f"GET /healthz round trip, median of {args.requests} per round, {args.rounds} rounds"
    )
    for col in ("event loop", "HTTP parser", "ms per round", "vs h11 (per round)"):
        table.add_column(col, justify="left" if col in ("event loop", "HTTP parser") else "right")
    base = results[("asyncio", "h11")]
    for (loop, http), values in results.items():
        table.add_row(
            loop,
            http,
            " / ".join(f"{v:.3f}" for v in values),
            " / ".join(f"{b / v:.2f}x" for b, v in zip(base, values)),
        )
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
