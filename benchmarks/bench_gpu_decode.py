"""The engine's decode step on a GPU: CUDA graphs against the eager step, in one run (issue 36, item 1).

Two engines of the project (`python -m services.engine`, bf16) on the same GPU, one with
`SHELLRL_CUDA_GRAPH=false` (the eager step: one transformers forward over the batch's own KV) and one
with graphs (services/engine/graph_decode.py), serving the same random-weight checkpoint of a real
architecture (benchmarks.model_shapes; default SmolLM2-135M's dimensions, nothing downloaded).

Decode: for each batch level, `level` concurrent requests of 64-token prompts and --new-tokens
tokens each (ignore_eos), so the running batch holds `level` rows for --new-tokens steps; the decode
step is the engine's own `shellrl_engine_decode_step_seconds` (sum / count over the wave, read from
/metrics before and after: a forward, sampling and the step's bookkeeping), and output tokens/s the
wave's. The levels are interleaved over --rounds rounds and both engines run each wave alternately
(a shared machine's noise hits both alike); the table gives medians and the graph/eager ratio.

Parity: the same greedy requests (temperature 0, 32 prompts of 96 tokens, --parity-tokens new
tokens) to both engines: the share of requests whose tokens are identical, and the largest
|log-prob difference| over the tokens both sampled before their first divergence (bfloat16
forwards that differ in kernel choice: the key length the attention sees differs).

Run: `python -m benchmarks.bench_gpu_decode --out DIR` (DIR/results.json, DIR/results.md); without
CUDA it prints a skip line and returns. `--quick`: levels 1 and 8, one round, 16 new tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.gpu_common import EngineProcess
from shellrl.clients.engine import EngineClient

console = Console(width=140)
STEP_METRIC = "shellrl_engine_decode_step_seconds"


def _metric_total(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not label or label in line):
            head = line.split(" ")[0]
            if head == name or head.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def _scrape(client: httpx.AsyncClient, url: str) -> dict:
    text = (await client.get(f"{url}/metrics")).text
    return {
        "sum": _metric_total(text, f"{STEP_METRIC}_sum"),
        "count": _metric_total(text, f"{STEP_METRIC}_count"),
        "graph": _metric_total(text, "shellrl_engine_decode_steps_total", 'mode="graph"'),
        "eager": _metric_total(text, "shellrl_engine_decode_steps_total", 'mode="eager"'),
    }


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 40000) for _ in range(n)]


async def _wave(url: str, prompts: list[list[int]], params: dict) -> dict:
    async with EngineClient([url], timeout_s=1800) as client, httpx.AsyncClient() as http:
        before = await _scrape(http, url)
        start = time.perf_counter()
        results = await asyncio.gather(*(client.generate(p, params) for p in prompts))
        wall = time.perf_counter() - start
        after = await _scrape(http, url)
    steps = after["count"] - before["count"]
    return {
        "tokens_per_s": sum(len(r.output_ids) for r in results) / wall,
        "step_ms": 1000 * (after["sum"] - before["sum"]) / max(steps, 1),
        "steps": steps,
        "graph_steps": after["graph"] - before["graph"],
        "eager_steps": after["eager"] - before["eager"],
    }


async def bench_decode(engines: dict[str, str], levels: list[int], new_tokens: int, rounds: int):
    rng = random.Random(0)
    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    samples: dict[str, dict[int, list[dict]]] = {n: {lv: [] for lv in levels} for n in engines}
    for url in engines.values():  # warm-up: allocator, first joins
        await _wave(url, [_prompt(rng, 64) for _ in range(4)], {**params, "max_new_tokens": 8})
    for _ in range(rounds):
        for level in levels:
            prompts = [_prompt(rng, 64) for _ in range(level)]
            for name, url in engines.items():
                samples[name][level].append(await _wave(url, prompts, params))
    rows = []
    for level in levels:
        row = {"batch": level}
        for name in engines:
            waves = samples[name][level]
            row[name] = {
                "step_ms": statistics.median(w["step_ms"] for w in waves),
                "tokens_per_s": statistics.median(w["tokens_per_s"] for w in waves),
                "graph_steps": sum(w["graph_steps"] for w in waves),
                "eager_steps": sum(w["eager_steps"] for w in waves),
            }
        row["step_ratio"] = row["graphs"]["step_ms"] / row["eager"]["step_ms"]
        rows.append(row)
    return rows


async def bench_parity(engines: dict[str, str], new_tokens: int, prompts: int = 32) -> dict:
    rng = random.Random(2)
    batch = [_prompt(rng, 96) for _ in range(prompts)]
    params = {"max_new_tokens": new_tokens, "temperature": 0.0}
    out = {}
    for name, url in engines.items():
        async with EngineClient([url], timeout_s=1800) as client:
            out[name] = await asyncio.gather(*(client.generate(p, params) for p in batch))
    same, max_diff, compared = 0, 0.0, 0
    for a, b in zip(out["eager"], out["graphs"]):
        same += a.output_ids == b.output_ids
        for ta, tb, la, lb in zip(a.output_ids, b.output_ids, a.output_logprobs, b.output_logprobs):
            if ta != tb:
                break
            max_diff, compared = max(max_diff, abs(la - lb)), compared + 1
    return {
        "requests": prompts,
        "identical_share": same / prompts,
        "max_abs_logprob_diff": max_diff,
        "tokens_compared": compared,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="smollm2-135m", help="benchmarks.model_shapes name")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--levels", default="1,8,32,64")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parity-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out/gpu-decode"))
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="where the random checkpoint goes (OUT/SHAPE)"
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        console.print("bench_gpu_decode: skipped (needs CUDA)")
        return
    from benchmarks.model_shapes import save_random_model

    if args.quick:
        args.levels, args.rounds, args.new_tokens, args.parity_tokens = "1,8", 1, 16, 8
    levels = [int(x) for x in args.levels.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir or args.out / args.shape
    if not (model_dir / "config.json").exists():
        save_random_model(args.shape, model_dir, device=args.device, logit_std=4.0)
    torch.cuda.empty_cache()
    env = {"SHELLRL_MAX_RUNNING_REQUESTS": str(max(64, *levels))}
    started = time.perf_counter()
    engines = {
        "eager": EngineProcess(
            model_dir,
            args.device,
            args.out / "eager.log",
            env={**env, "SHELLRL_CUDA_GRAPH": "false"},
        ),
        "graphs": EngineProcess(
            model_dir,
            args.device,
            args.out / "graphs.log",
            env={**env, "SHELLRL_CUDA_GRAPH": "true"},
        ),
    }
    try:
        for engine in engines.values():
            engine.start()
        console.print(f"engines ready after {time.perf_counter() - started:.1f} s")
        urls = {name: e.url for name, e in engines.items()}
        decode = asyncio.run(bench_decode(urls, levels, args.new_tokens, args.rounds))
        parity = asyncio.run(bench_parity(urls, args.parity_tokens))
    finally:
        for engine in engines.values():
            engine.stop()
    results = {
        "shape": args.shape,
        "device": torch.cuda.get_device_name(args.device),
        "torch": torch.__version__,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "decode": decode,
        "parity": parity,
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    table = Table(
        title=f"Decode step, {args.shape} bf16 on {results['device']}: eager vs CUDA graphs "
        f"(engine metric, median of {args.rounds} rounds, {args.new_tokens} new tokens)"
    )
    for column in (
        "batch",
        "eager step ms",
        "graphs step ms",
        "graphs / eager",
        "eager tok/s",
        "graphs tok/s",
        "graph steps / eager steps (graphs engine)",
    ):
        table.add_column(column, justify="right")
    for row in decode:
        e, g = row["eager"], row["graphs"]
        table.add_row(
            str(row["batch"]),
            f"{e['step_ms']:.2f}",
            f"{g['step_ms']:.2f}",
            f"{row['step_ratio']:.3f}x",
            f"{e['tokens_per_s']:.0f}",
            f"{g['tokens_per_s']:.0f}",
            f"{g['graph_steps']:.0f} / {g['eager_steps']:.0f}",
        )
    console.print(table)
    console.print(f"parity (greedy): {json.dumps(parity)}")
    with (args.out / "results.md").open("w") as f:
        Console(file=f, width=140).print(table)
        f.write(f"\nparity (greedy): {json.dumps(parity)}\n")


if __name__ == "__main__":
    main()
