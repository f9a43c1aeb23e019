"""Weight push through SGLang's envelope (issue 16): `python -m benchmarks.bench_weight_envelope
[--repeats N] [--threads N] [--quick]` (`--quick`: the tiny test model, one push per transport,
the 'before' row on this tree's own engine).

One real `python -m services.engine` process with SmolLM2-135M-Instruct (513 MiB of float32
parameters); the learner side is this process with the learner's own buckets, through the real
`EngineClient`. A push = the learner's tensors in memory -> the engine reports the new version
(begin_weight_update, the update call(s), end_weight_update, /model_info). Rows, in one run:
1. safetensors on disk: write + `/update_weights_from_disk` (the baseline of "x faster").
2. before: the engine of `--before-ref` (default HEAD, extracted with `git archive` into a temp
   directory, its own process) and that tree's learner default: shellrl's JSON payload over a kept
   POSIX segment holding the parameters (`SharedMemoryBucket.adopt`).
3. now: this tree's engine and learner default: SGLang's envelope (base64 ForkingPickler dump,
   file-system shared memory) over a kept bucket holding the parameters (`SharedTensorBucket.adopt`).
   Rows 2 and 3 alternate push by push, so load on a shared machine hits both alike.
4. distributed: one gloo broadcast of the flattened bucket (`update_weights_from_distributed`),
   the parameters living in the broadcast bucket (`FlatBucket.adopt`).
Each transport has warm-up pushes first (both arenas, the first mapping), and an in-place
optimizer-like step before each push, outside the timed span. Median of `--repeats`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
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
from tests.helpers.processes import ServiceProcess  # noqa: E402
from tests.helpers.redis_server import free_port  # noqa: E402

console = Console()
ROWS = {
    "disk": "safetensors on disk: write + /update_weights_from_disk",
    "json": "before: shellrl JSON payload, kept POSIX segment (adopt)",
    "envelope": "now: SGLang envelope, kept file-system shm bucket (adopt)",
    "gloo": "distributed: one gloo broadcast (update_weights_from_distributed)",
}


def start_before_engine(
    ref: str, tree: Path, log_dir: Path, threads: int, model: str = "smollm2"
) -> ServiceProcess:
    """The engine of git `ref`, from its own extracted tree (the repository is only read)."""
    archive = subprocess.run(
        ["git", "archive", ref], cwd=REPO, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    env = {
        "SHELLRL_MODEL_PATH": model,
        "SHELLRL_LOG_LEVEL": "WARNING",
        "SHELLRL_NUM_THREADS": str(threads),
        "PYTHONPATH": str(tree),
    }
    engine = ServiceProcess("engine", free_port(), env, log_dir)
    engine._log = open(engine.log_path, "ab")
    engine.proc = subprocess.Popen(
        [sys.executable, "-m", "services.engine"],
        cwd=tree,
        start_new_session=True,
        env=engine.env,
        stdout=engine._log,
        stderr=subprocess.STDOUT,
    )
    engine.wait_ready(300)
    return engine


async def bench(
    url: str, before_url: str, repeats: int, model_path: str = "smollm2"
) -> tuple[Table, dict[str, float]]:
    import torch

    from services.learner.weights.engine_groups import EngineGroups
    from shellrl.models import load_model
    from shellrl.weights import disk as wtd
    from shellrl.weights import distributed as wdist
    from shellrl.weights import sglang as wsg
    from shellrl.weights import shm

    model = load_model(model_path)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    times: dict[str, list[float]] = {k: [] for k in ROWS}
    scratch = tempfile.mkdtemp(prefix="bench-envelope-")
    counter = iter(range(10**6))

    def named() -> list:
        return [(n, p.detach()) for n, p in model.named_parameters()]

    def params() -> list:
        return [p for _, p in model.named_parameters()]

    async def timed(name: str, push, target: str, warm_up: int = 2, rounds: int = repeats) -> None:
        for i in range(warm_up + rounds):
            with torch.no_grad():  # an optimizer step, in place, where the parameters live
                for p in params():
                    p.add_(1e-4)
            start = time.perf_counter()
            version = f"{name}-{next(counter)}"
            await push(version)
            assert (await client.get_weight_version(urls=[target]))[target] == version
            if i >= warm_up:
                times[name].append(time.perf_counter() - start)

    async with EngineClient(sorted({url, before_url}), timeout_s=600) as client:

        async def push_disk(version: str) -> None:
            directory = Path(scratch) / version
            wtd.save_safetensors_dir(named(), directory)
            await client.update_weights_from_disk(str(directory), version, urls=[url])
            shutil.rmtree(directory)

        async def push_json(version: str) -> None:
            await client.update_weights_from_tensor(
                [json_bucket.refill(named()).payload()], weight_version=version, urls=[before_url]
            )

        async def push_envelope(version: str) -> None:
            await client.update_weights_from_tensor(
                envelope.refill(named()).entries(1), weight_version=version, urls=[url]
            )

        async def push_gloo(version: str) -> None:
            flat.refill(named())
            await client.begin_weight_update(urls=[url])
            await groups.broadcast(
                url,
                group,
                flat.tensor,
                client.update_weights_from_distributed(
                    **wdist.request_fields(named()),
                    group_name=group.name,
                    weight_version=version,
                    urls=[url],
                ),
            )
            await client.end_weight_update(urls=[url])

        # the parameters live in the JSON bucket's segment, and a copy of them in the envelope bucket
        # (both rows see the same optimizer step: the envelope bucket is refilled from them)
        json_bucket = shm.SharedMemoryBucket(named())
        json_bucket.adopt(params())
        envelope = wsg.SharedTensorBucket(named())
        try:
            await timed("disk", push_disk, url)
            await timed("json", push_json, before_url, rounds=0)
            await timed("envelope", push_envelope, url, rounds=0)
            json_bucket.close()
            envelope.close()
            for _ in range(
                repeats
            ):  # alternate: one push of each, the parameters adopted by each in turn
                json_bucket = shm.SharedMemoryBucket(named())
                json_bucket.adopt(params())
                await timed("json", push_json, before_url, warm_up=1, rounds=1)
                json_bucket.close()
                envelope = wsg.SharedTensorBucket(named())
                envelope.adopt(params())
                await timed("envelope", push_envelope, url, warm_up=1, rounds=1)
                envelope.close()
            groups = EngineGroups(client, backend="gloo", timeout_s=120)
            group = await groups.group(url, 1)
            flat = wdist.FlatBucket(named(), "cpu")
            flat.adopt(params())
            await timed("gloo", push_gloo, url)
            flat.close()
            groups.close()
        finally:
            json_bucket.close()
            envelope.close()
            shutil.rmtree(scratch, ignore_errors=True)
    median = {k: statistics.median(v) for k, v in times.items()}
    table = Table(
        title=f"Whole-model push, learner memory to live weights ({nbytes / 2**20:.0f} MiB float32, "
        f"median of {repeats})"
    )
    for column in ("transport", "seconds", "vs disk", "vs before"):
        table.add_column(column, justify="right")
    for key, label in ROWS.items():
        table.add_row(
            label,
            f"{median[key]:.3f}",
            f"{median['disk'] / median[key]:.2f}x faster",
            f"{median[key] / median['json']:.2f}x the time",
        )
    return table, median


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_weight_envelope", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="engine torch threads (0: torch's default)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="pushes per transport")
    parser.add_argument(
        "--before-ref", default="HEAD", help="git ref of the 'before' engine and learner"
    )
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny or a HF directory")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the tiny test model, 1 push each, the 'before' row on this tree's engine (no "
        "second engine): a smoke run",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.repeats = "tiny", 1
    console.print(
        f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
        f"engine threads: {args.threads or 'torch default'}"
    )
    with tempfile.TemporaryDirectory() as logs, tempfile.TemporaryDirectory() as tree:
        engine = start_engine(Path(logs), args.threads, model=args.model)
        before = None
        try:
            if not args.quick:
                before = start_before_engine(
                    args.before_ref, Path(tree), Path(logs), args.threads, args.model
                )
            before_url = before.url if before is not None else engine.url
            table, _ = asyncio.run(bench(engine.url, before_url, args.repeats, args.model))
            console.print(table)
        finally:
            engine.stop()
            if before is not None:
                before.stop()
    console.print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
