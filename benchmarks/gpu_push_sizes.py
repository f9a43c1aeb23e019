"""Push time and memory at model sizes (issue 30 "streamed bounded buckets", issue 36.3): the
learner's own `WeightSync.push` from a float32 learner model into the project's engine, old against
new, alternating in one process on one engine:

  stream   buckets of --bucket-mib (512 MiB) streamed through two slots, cast to the engine's
           dtype (SHELLRL_WEIGHT_SYNC_DTYPE=auto: bfloat16 for the engine on a GPU; a CPU engine
           serves float32, which is never cast down)
  old      the whole model in ONE float32 bucket (bucket budget larger than the model, dtype
           float32): what cuda_ipc did before the streamed buckets

Transport: cuda_ipc when the engine is on a GPU, else shm without shared parameters (the same
streamed slots in shared memory, so the section runs on a CPU at small shapes: the test of its
logic). Two streamed pushes first (not measured) let the engine allocate its staging arenas.
Per variant and shape: push time (median, p90 over --updates pushes after 2 warm-ups) and
its phases; memory: the learner's slots at their largest (`BucketStream.peak_resident_bytes`,
what the learner adds to the engine's GPU or to shared memory), the learner process's
`torch.cuda.max_memory_allocated` above what it held before the variant (learner and engine share
the GPU here: the slots live on it), the GPU's used memory (nvidia-smi sampled every 20 ms) at its
peak above the variant's start (both processes, CUDA IPC mappings included), and the engine's own
allocator (its /metrics `shellrl_gpu_memory_bytes`: allocated after, peak since its start). The
bound checked: slots <= 2 x bucket budget + the largest tensor (in the sent dtype). The ratio row:
stream / old push time (issue 36's target for the envelope at 0.5B: <= 1.2x).

Each shape: a random model (benchmarks.model_shapes) saved in bfloat16 for the engine, then held
by the learner in float32 (7B: 30 GB + the engine's 15 GB, its staging arena 15 GB, the old path's
30 GB bucket: ~95 GB of an H200's 141 GB).
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path

import httpx
from rich.table import Table

VARIANTS = ("stream", "old")  # stream first: the old path's whole-model bucket stays mapped by
# the engine (it keeps a whole-model buffer) until its next bucket, which would count in the
# next variant's baseline; a streamed bucket is never kept
WARMUPS = 2


class GpuUsedSampler:
    """The GPU's used memory (nvidia-smi, MiB -> bytes) sampled every `interval_ms` in a thread
    while active; `peak_bytes` the largest sample. No samples without nvidia-smi."""

    def __init__(self, index: int, interval_ms: int = 20) -> None:
        self.index, self.interval_ms = index, interval_ms
        self.samples: list[int] = []
        self._proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> GpuUsedSampler:
        if shutil.which("nvidia-smi") is None:
            return self
        self._proc = subprocess.Popen(
            [
                "nvidia-smi",
                f"--id={self.index}",
                "--query-gpu=memory.used",
                "--format=csv,noheader,nounits",
                f"--loop-ms={self.interval_ms}",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        time.sleep(0.2)  # the first sample: the level before the pushes
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            if line.strip().isdigit():
                self.samples.append(int(line.strip()) << 20)

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
            self._reader.join(5)

    @property
    def peak_added_bytes(self) -> int | None:
        return max(self.samples) - self.samples[0] if self.samples else None


async def engine_gpu_bytes(url: str) -> dict[str, float]:
    """The engine's allocator: {kind: bytes} of shellrl_gpu_memory_bytes summed over devices."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=30.0) as http:
        text = (await http.get(f"{url}/metrics")).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "shellrl_gpu_memory_bytes":
            for sample in family.samples:
                kind = sample.labels["kind"]
                out[kind] = out.get(kind, 0.0) + sample.value
    return out


def summary_ms(samples_s: list[float]) -> dict:
    from benchmarks.gpu_common import summary_ms as summary

    return summary(samples_s)


def variant_sync(variant: str, client, args, work: Path, on_gpu: bool):
    from services.learner.weights.weight_sync import WeightSync

    return WeightSync(
        client,
        None,
        transport="cuda_ipc" if on_gpu else "shm",
        deadline_s=300.0,
        sync_dir=work / "sync",
        engine_device=args.engine_device if on_gpu else None,
        share_parameters=False,
        bucket_bytes=(1 << 62) if variant == "old" else args.bucket_mib << 20,
        dtype="float32" if variant == "old" else "auto",
    )


async def run_variant(variant: str, model, client, url: str, work: Path, args, version: int):
    """WARMUPS + args.updates pushes of one variant; returns (result row, last version)."""
    import torch

    from benchmarks.gpu_floors import mark_version

    on_gpu = args.engine_device.startswith("cuda")
    learner_gpu = args.learner_device.startswith("cuda")
    gc.collect()
    before_learner = 0
    if learner_gpu:
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
        before_learner = torch.cuda.memory_allocated(args.learner_device)
        torch.cuda.reset_peak_memory_stats(args.learner_device)
    sync = variant_sync(variant, client, args, work, on_gpu)
    totals, phases, peak_slots, buckets = [], {}, 0, 0
    index = (torch.device(args.engine_device).index or 0) if on_gpu else 0
    try:
        with GpuUsedSampler(index) as sampler:
            for i in range(WARMUPS + args.updates):
                version += 1
                expected = mark_version(model, version)
                if learner_gpu:
                    torch.cuda.synchronize()  # "optimizer step done"
                t0 = time.perf_counter()
                result = await sync.push(model, version)
                elapsed = time.perf_counter() - t0
                if not result.confirmed:
                    raise RuntimeError(f"{variant}: push failed: {result.failed}")
                stream = sync.staging.stream
                if stream is not None:
                    peak_slots = max(peak_slots, stream.peak_resident_bytes)
                    buckets = len(stream.buckets)
                if i >= WARMUPS:
                    totals.append(elapsed)
                    for phase, seconds in result.phases.items():
                        phases.setdefault(phase, []).append(seconds)
        async with httpx.AsyncClient(timeout=60.0) as http:
            served = (
                await http.post(
                    f"{url}/get_weights_by_name",
                    json={"name": "model.norm.weight", "truncate_size": 1},
                )
            ).json()
        row = {
            "variant": variant,
            "learner_allocated_before_bytes": before_learner if learner_gpu else None,
            "dtype": sync.push_dtype,
            "buckets": buckets,
            "total": summary_ms(totals),
            "phases_median_ms": {p: 1e3 * statistics.median(v) for p, v in phases.items()},
            "slots_peak_bytes": peak_slots,
            "gpu_used_peak_added_bytes": sampler.peak_added_bytes,
            "served_value_ok": served[0] == expected,
        }
        if learner_gpu:
            row["learner_peak_added_bytes"] = (
                torch.cuda.max_memory_allocated(args.learner_device) - before_learner
            )
        if on_gpu:
            row["engine_allocator_bytes"] = await engine_gpu_bytes(url)
    finally:
        sync.close()
    return row, version


async def prime(model, client, work: Path, args, version: int) -> int:
    """Two streamed pushes before any measurement: the engine allocates its staging arenas (its
    own memory, not the push's) at its first updates."""
    sync = variant_sync("stream", client, args, work, args.engine_device.startswith("cuda"))
    try:
        for _ in range(2):
            version += 1
            result = await sync.push(model, version)
            if not result.confirmed:
                raise RuntimeError(f"priming push failed: {result.failed}")
    finally:
        sync.close()
    return version


def largest_tensor_bytes(model, dtype) -> int:
    """The largest parameter's bytes as sent (in `dtype`, None: its own)."""
    return max(
        p.numel() * (dtype.itemsize if dtype else p.element_size()) for p in model.parameters()
    )


async def shape_section(shape: str, args, results: dict) -> None:
    """One shape: build, start the engine, alternate the variants, check the memory bound."""
    import torch

    from benchmarks.gpu_common import EngineProcess
    from benchmarks.model_shapes import save_random_model
    from shellrl.clients.engine import EngineClient

    work = Path(args.work_dir) / f"sizes-{shape}"
    shutil.rmtree(work, ignore_errors=True)
    out = results.setdefault("sizes", {}).setdefault(shape, {})
    t0 = time.perf_counter()
    model = save_random_model(shape, work / "model", device=args.learner_device)  # bf16 on disk
    model = model.float()  # the learner's float32
    out["build_s"] = time.perf_counter() - t0
    out["float32_bytes"] = sum(p.numel() * 4 for p in model.parameters())
    out["tensors"] = sum(1 for _ in model.parameters())
    engine = EngineProcess(work / "model", args.engine_device, work / "engine.log")
    t0 = time.perf_counter()
    engine.start()
    out["engine_start_s"] = time.perf_counter() - t0
    client = EngineClient(engine.url, timeout_s=600.0)
    version = 0
    try:
        if args.engine_device.startswith("cuda"):
            out["engine_allocator_at_start"] = await engine_gpu_bytes(engine.url)
        version = await prime(model, client, work, args, version)
        if args.engine_device.startswith("cuda"):
            out["engine_allocator_primed"] = await engine_gpu_bytes(engine.url)
        for _ in range(args.rounds):
            for variant in args.variants.split(","):
                try:
                    row, version = await run_variant(
                        variant, model, client, engine.url, work, args, version
                    )
                except Exception as exc:  # noqa: BLE001 - one variant failing keeps the others
                    row = {"variant": variant, "error": f"{type(exc).__name__}: {exc}"}
                    row["engine_log"] = engine.tail()
                    version += 1000
                out.setdefault("rounds", []).append(row)
                out[variant] = row  # the last round's
        sent = torch.bfloat16 if out.get("stream", {}).get("dtype") == "bfloat16" else None
        out["largest_tensor_sent_bytes"] = largest_tensor_bytes(model, sent)
        out["bound_bytes"] = 2 * (args.bucket_mib << 20) + out["largest_tensor_sent_bytes"]
        stream, old = out.get("stream", {}), out.get("old", {})
        if "total" in stream and "total" in old:
            out["stream_over_old"] = stream["total"]["median_ms"] / old["total"]["median_ms"]
            out["within_bound"] = stream["slots_peak_bytes"] <= out["bound_bytes"]
    finally:
        await client.close()
        engine.stop()
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        shutil.rmtree(work, ignore_errors=True)


def sizes_section(args, results: dict) -> None:
    for shape in [s for s in args.sizes_shapes.split(",") if s]:
        asyncio.run(shape_section(shape, args, results))


def _gb(value) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def sizes_table(sizes: dict) -> Table:
    table = Table(
        title="Push at sizes: old whole-model float32 bucket vs streamed buckets in the engine's "
        "dtype (WeightSync.push, one engine)"
    )
    for col in (
        "model",
        "variant",
        "dtype",
        "buckets",
        "median ms",
        "p90 ms",
        "fill / transfer / load ms",
        "slots GB",
        "learner alloc +GB",
        "GPU used +GB",
        "served ok",
        "n",
    ):
        table.add_column(col, justify="left" if col in ("model", "variant") else "right")
    for shape, out in sizes.items():
        for variant in VARIANTS:
            r = out.get(variant)
            if r is None:
                continue
            if "error" in r:
                table.add_row(shape, variant, "failed", r["error"][:80], *[""] * 8)
                continue
            p = r["phases_median_ms"]
            table.add_row(
                shape,
                variant,
                r["dtype"],
                str(r["buckets"]),
                f"{r['total']['median_ms']:.2f}",
                f"{r['total']['p90_ms']:.2f}",
                f"{p.get('fill', 0):.2f} / {p.get('transfer', 0):.2f} / {p.get('load', 0):.2f}",
                _gb(r["slots_peak_bytes"]),
                _gb(r.get("learner_peak_added_bytes")),
                _gb(r.get("gpu_used_peak_added_bytes")),
                str(r["served_value_ok"]),
                str(r["total"]["n"]),
            )
        if "stream_over_old" in out:
            table.add_row(
                shape,
                "stream / old",
                "",
                "",
                f"{out['stream_over_old']:.2f}x",
                "",
                "",
                f"bound {_gb(out['bound_bytes'])}: {'ok' if out['within_bound'] else 'EXCEEDED'}",
                *[""] * 4,
            )
    return table
