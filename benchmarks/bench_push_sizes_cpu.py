"""Weight pushes at the sizes people train, on CPU, into SGLang 0.5.23's own receiving code (issue 30
items 1 and 8): `python -m benchmarks.bench_push_sizes_cpu [--shapes qwen2.5-0.5b,qwen2.5-1.5b]
[--transports shm,distributed] [--repeats 2] [--quick]` (`--quick`: 2 layers of the 0.5B shape,
shm and distributed, one push each).

The learner is this process: a float32 model of the shape (benchmarks.model_shapes; random
weights) and its real `WeightSync`; the engine is one SGLang TP rank in its own process running
the wheel's SchedulerWeightUpdaterManager and model-runner loaders over a bfloat16 copy of the
tensors (tests/helpers/sglang_tp_rank.py, the conformance harness's rank; its HTTP front
tests/fakes/sglang_front.py says bfloat16 in /server_info). Variants, alternating per shape:

  stream 128 / stream 512   buckets of 128 / 512 MiB in the engine's bfloat16 (shm: two slots
                            streamed; distributed: one kept bucket per split)
  old                       the whole model in one float32 bucket (SHELLRL_WEIGHT_SYNC_DTYPE=
                            float32, a budget above the model; shm: the parameters live in the
                            kept segment, the learner's default before)

Each variant keeps its WeightSync across its pushes, as the learner does; the variants alternate
push by push. Memory on each side (shared memory a process mapped included): "kept", the RSS a
variant's first push left behind (its slots or segment, the engine's last mapping; the old shm
variant moves the parameters into its segment, so nothing is added), and "push peak", the peak RSS
during a later push (VmHWM, reset through /proc/<pid>/clear_refs) above the RSS before it. Time:
median of --repeats pushes after that first one. Then the bound of item 1 by accounting for every
shape, 7B included (tensors on the meta device): the two slots at their largest (two consecutive
buckets) against 2 x bucket + the largest tensor, and what the whole model takes in float32.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Listener
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

console = Console()
VARIANTS = {  # "old" first: its shm segment adopts the parameters before the others see them
    "old": (0, "float32"),
    "stream 128": (128 << 20, "auto"),
    "stream 512": (512 << 20, "auto"),
}
URL = "http://sglang.bench:30000"
MIB = 1 << 20


def rss_bytes(pid: int | str = "self") -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value = line.split(":")
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def unfit_reason(transport: str, variant: str, fp32_bytes: int) -> str | None:
    """Why `variant` over `transport` cannot run on this machine now, or None. The old distributed
    push holds the whole model twice more in float32 (the learner's send bucket and the engine's
    receive bucket) beside both models: at 1.5B that is 11.8 GB more, which a 24 GiB VM running
    anything else does not have (the OOM killer then ends the benchmark). 10% margin."""
    if transport != "distributed" or VARIANTS[variant][0] != 0:
        return None
    meminfo = Path("/proc/meminfo").read_text().split()
    available = int(meminfo[meminfo.index("MemAvailable:") + 1]) * 1024
    need = 2 * fp32_bytes
    if need * 1.1 <= available:
        return None
    return (
        f"skipped: needs ~{need / MIB:,.0f} MiB more (float32 send and receive buckets), "
        f"{available / MIB:,.0f} MiB available"
    )


def reset_peak(pid: int | str = "self") -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def learner_model(shape: str, layers: int | None):
    """A float32 model of `shape` (random weights), its layer count cut to `layers` if given."""
    import torch
    from transformers import Qwen2ForCausalLM

    from benchmarks.model_shapes import qwen2_config

    config = qwen2_config(shape)
    if layers is not None:
        config.num_hidden_layers = layers
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=generator)
    return model.requires_grad_(False)


class Rank:
    """One SGLang TP rank process (the conformance harness's) and its connection."""

    def __init__(self, tmp: Path, shapes: dict) -> None:
        from tests.helpers.processes import REPO as repo
        from tests.helpers.redis_server import free_port

        key = secrets.token_bytes(16)
        self.listener = Listener(str(tmp / "rank.sock"), family="AF_UNIX", authkey=key)
        env = {**os.environ, "SGLANG_HARNESS_KEY": key.hex(), "PYTHONPATH": str(repo)}
        argv = [sys.executable, "-m", "tests.helpers.sglang_tp_rank", self.listener.address,
                "0", "1", str(free_port()), json.dumps(shapes), "0"]  # fmt: skip
        import subprocess

        self.proc = subprocess.Popen(argv, cwd=repo, env=env)
        self.conn = self.listener.accept()
        self.conn.recv()

    def close(self) -> None:
        self.conn.send(("exit", None))
        self.conn.recv()
        self.proc.wait(timeout=120)
        self.listener.close()


class Pusher:
    """One variant's WeightSync, kept across its pushes as the learner keeps it (slots, segments,
    the distributed group), with its own client on the rank's HTTP front."""

    def __init__(self, rank: Rank, variant: str, transport: str, model, tmp: Path) -> None:
        import httpx

        from services.learner.weights.weight_sync import WeightSync
        from shellrl.clients.engine import EngineClient
        from tests.fakes.sglang_front import SGLangFront

        bucket_bytes, dtype = VARIANTS[variant]
        if not bucket_bytes:  # above the model: one bucket
            bucket_bytes = 2 * sum(p.numel() * 4 for p in model.parameters())
        self.rank, self.front = rank, SGLangFront([rank.conn])
        self.client = EngineClient([URL], transport=httpx.MockTransport(self.front), timeout_s=600)
        # old: the parameters live in its kept buckets (the learner's default); the streamed
        # variants copy (cast) into their two slots, never adopting them
        args = {"share_parameters": variant == "old", "transport": transport}
        if transport == "distributed":
            args.update(backend="gloo", master_address="127.0.0.1")
        self.sync = WeightSync(self.client, None, deadline_s=600, sync_dir=tmp,
                               bucket_bytes=bucket_bytes, dtype=dtype, **args)  # fmt: skip

    async def push(self, model, version: int) -> tuple[float, int, int]:
        """(seconds, learner peak extra, engine peak extra) of one push, in bytes."""
        gc.collect()
        learner_before, engine_before = rss_bytes()[0], rss_bytes(self.rank.proc.pid)[0]
        reset_peak()
        reset_peak(self.rank.proc.pid)
        start = time.perf_counter()
        result = await self.sync.push(model, version)
        seconds = time.perf_counter() - start
        assert result.confirmed == (URL,), result.failed
        return (
            seconds,
            rss_bytes()[1] - learner_before,
            rss_bytes(self.rank.proc.pid)[1] - engine_before,
        )

    async def close(self) -> None:
        groups = [] if self.sync.groups is None else list(self.sync.groups._groups.values())
        self.sync.close()  # a shared-parameter segment gives the parameters back
        await self.client.close()
        for group in groups:  # what the learner's next group() would destroy on the engine
            await self.front.ask("destroy_weights_update_group", {"group_name": group.name})


def bound_rows(shapes: list[str], budgets: list[int]) -> list[tuple]:
    """(shape, budget MiB, buckets, slots at their largest, 2 x budget + largest, whole model
    float32) by accounting on the meta device, in bfloat16."""
    import torch
    from transformers import Qwen2ForCausalLM

    from benchmarks.model_shapes import qwen2_config
    from services.learner.weights.weight_transport import split_buckets
    from shellrl.weights import bucket as wt

    rows = []
    for shape in shapes:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(qwen2_config(shape))
        named = list(model.named_parameters())
        fp32 = sum(p.numel() * 4 for _, p in named)
        largest = max(p.numel() * 2 for _, p in named)
        for budget in budgets:
            buckets = split_buckets(named, budget, torch.bfloat16)
            sizes = [wt.plan_bucket(wt.describe(b, torch.bfloat16), 1)[1] for b in buckets]
            pairs = [a + b for a, b in zip(sizes, sizes[1:])] or sizes
            rows.append(
                (shape, budget // MIB, len(buckets), max(pairs), 2 * budget + largest, fp32)
            )
    return rows


async def bench(args) -> list[Table]:
    tables = []
    timing = Table(
        title=f"Push into SGLang 0.5.23's own receiving code, one TP rank on CPU (median of "
        f"{args.repeats} after a first push; memory: RSS kept after the first push, VmHWM above "
        "the RSS before a push)"
    )
    for column in ("shape", "transport", "variant", "dtype", "seconds", "learner kept MiB",
                   "learner push peak MiB", "engine kept MiB", "engine push peak MiB",
                   "time / first variant"):  # fmt: skip
        timing.add_column(column, justify="right")
    for shape in args.shapes:
        model = learner_model(shape, args.layers)
        shapes = {n: list(p.shape) for n, p in model.named_parameters()}
        with tempfile.TemporaryDirectory() as tmp:
            rank = Rank(Path(tmp), shapes)
            try:
                version = 0
                for transport in args.transports:
                    fp32 = sum(p.numel() * 4 for p in model.parameters())
                    unfit = {v: unfit_reason(transport, v, fp32) for v in args.variants}
                    for variant, reason in unfit.items():
                        if reason:
                            console.print(f"{shape} {transport} {variant}: {reason}")
                    variants = [v for v in args.variants if not unfit[v]]
                    pushers, kept, samples = {}, {}, {v: [] for v in variants}
                    try:
                        for variant in variants:  # warm-up: what each keeps between pushes
                            gc.collect()
                            before = rss_bytes()[0], rss_bytes(rank.proc.pid)[0]
                            pushers[variant] = Pusher(rank, variant, transport, model, Path(tmp))
                            version += 1
                            await pushers[variant].push(model, version)
                            gc.collect()
                            kept[variant] = (
                                rss_bytes()[0] - before[0],
                                rss_bytes(rank.proc.pid)[0] - before[1],
                            )
                        for _ in range(args.repeats):  # interleaved
                            for variant, pusher in pushers.items():
                                version += 1
                                samples[variant].append(await pusher.push(model, version))
                    finally:
                        for pusher in pushers.values():
                            await pusher.close()
                    first = samples.get("old") or next(iter(samples.values()), [(1.0,)])
                    old = statistics.median(s[0] for s in first)
                    label = shape if args.layers is None else f"{shape} ({args.layers} layers)"
                    for variant, rows in samples.items():
                        median = [statistics.median(r[k] for r in rows) for k in range(3)]
                        timing.add_row(label, transport, variant, pushers[variant].sync.push_dtype,
                                       f"{median[0]:.2f}", f"{kept[variant][0] / MIB:.0f}",
                                       f"{median[1] / MIB:.0f}", f"{kept[variant][1] / MIB:.0f}",
                                       f"{median[2] / MIB:.0f}", f"{median[0] / old:.2f}x")  # fmt: skip
                    for variant in (v for v in args.variants if unfit[v]):
                        timing.add_row(label, transport, variant, "-", unfit[variant],
                                       *["-"] * 5)  # fmt: skip
            finally:
                rank.close()
        del model
        gc.collect()
    tables.append(timing)
    bounds = Table(title="Slots of a streamed bfloat16 push at their largest, by accounting (meta)")
    for column in ("shape", "bucket MiB", "buckets", "two slots MiB", "2 x bucket + largest MiB",
                   "whole model float32 MiB"):  # fmt: skip
        bounds.add_column(column, justify="right")
    for shape, budget, count, pair, bound, fp32 in bound_rows(
        args.bound_shapes, [128 << 20, 512 << 20]
    ):
        assert pair <= bound, (shape, budget, pair, bound)
        bounds.add_row(shape, str(budget), str(count), f"{pair / MIB:.0f}", f"{bound / MIB:.0f}",
                       f"{fp32 / MIB:.0f}")  # fmt: skip
    tables.append(bounds)
    return tables


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_push_sizes_cpu", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b")
    parser.add_argument("--transports", default="shm,distributed")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"of {list(VARIANTS)}, in this order"
    )
    parser.add_argument("--repeats", type=int, default=2, help="measured pushes per variant")
    parser.add_argument("--layers", type=int, default=None, help="cut every shape to N layers")
    parser.add_argument("--bound-shapes", default="qwen2.5-0.5b,qwen2.5-1.5b,qwen2.5-7b")
    parser.add_argument("--quick", action="store_true", help="2 layers of 0.5B, one push each")
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.layers, args.repeats = "qwen2.5-0.5b", 2, 1
        args.bound_shapes = "qwen2.5-0.5b,qwen2.5-7b"
    args.shapes, args.transports = args.shapes.split(","), args.transports.split(",")
    args.variants = args.variants.split(",")
    args.bound_shapes = args.bound_shapes.split(",")
    console.print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for table in asyncio.run(bench(args)):
        console.print(table)
    console.print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
