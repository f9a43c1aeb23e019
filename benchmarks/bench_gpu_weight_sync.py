"""Weight sync learner GPU -> engine GPU, log-prob parity and learner memory, on two GPUs (issue 9).

Learner: this process, model on --learner-device (cuda:0). Engine: the project's engine
(`python -m services.engine`, bf16) in its own process on --engine-device (cuda:1). Models:
Qwen2.5-0.5B and Qwen2.5-7B architectures with random weights (benchmarks.model_shapes; nothing is
downloaded). One update = from "optimizer step done" (learner GPU synchronized) to "the engine
serves the new version": learner-side copies (begin_weight_update is sent meanwhile, as
WeightSync does), update_weights_from_tensor (or _from_disk), end_weight_update (the engine
swaps the staged tensors into its parameters and drops its prefix cache), and a /model_info read
that reports the new weight_version. "serving" is the
same without that read: end_weight_update returns after the swap, so the engine already serves the
new version when it answers (the read is a check, which WeightSync.push also makes).

Paths (sync section):
  a  per-tensor     each tensor copied straight from the learner GPU into a kept bucket on the
                    engine GPU (one copy per tensor across the link), CUDA IPC handle to the engine
  b  bucket         flatten on the learner GPU and copy the bucket to the engine GPU in 8 large DMAs,
                    each overlapping the flatten of the next chunk (CudaIpcBucket), CUDA IPC
                    handle in shellrl's JSON payload (the engine's extension)
  e  envelope       as b, sent as SGLang's envelope (`CudaIpcBucket.entries`: a fresh torch CUDA
                    IPC share per update, metadata pickled once per layout): what WeightSync sends
  c  host-staged    flatten on the learner GPU, ONE copy to a page-locked shared-memory segment,
                    the engine copies it up (for GPUs without peer access)
  d  disk           safetensors on local disk + /update_weights_from_disk
  w  WeightSync     services.learner.weights.weight_sync.WeightSync.push (the learner service's own code,
                    engine_device = the engine's GPU: a kept bucket there, fill(sync=False), the
                    session opened during the copies, then the /model_info check)
  floor             raw device-to-device copy of the same bytes (cuda:0 -> cuda:1), no engine

Sizes section (`--sections sizes`, benchmarks/gpu_push_sizes.py): the learner's WeightSync.push
from a float32 model at --sizes-shapes, the old whole-model float32 bucket against streamed
buckets of --bucket-mib in the engine's dtype: push time, slots, learner and GPU memory added,
the stream / old ratio and the memory bound (2 x bucket + the largest tensor). Also runs on CPU
(`--learner-device cpu --engine-device cpu --sizes-shapes qwen2-small`: shm, float32).

Parity section: shellrl/rl/logprobs.py (float32 per sequence) vs the engine's sampled log-probs,
before and after one Trainer step + weight push (benchmarks/gpu_parity.py). Memory section:
log-prob + backward at B=8, L=1000 (benchmarks/gpu_memory.py).

Run (on the lent nvidia-h200-x2): `python -m benchmarks.bench_gpu_weight_sync --out DIR`; writes
DIR/results.json and DIR/results.md. Without CUDA it prints a skip line and returns (make bench).
`--quick`: the 0.5B shape, paths b and w, 2 updates, 2 parity prompts (a smoke run).
One H200, both sizes, old vs streamed (benchmarks/run_gpu_stack.sh push-sizes): `python -m
benchmarks.bench_gpu_weight_sync --learner-device cuda:0 --engine-device cuda:0 --sections sizes
--updates 10 --out DIR`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import time
from pathlib import Path

import httpx
from rich.console import Console

from benchmarks.gpu_common import EngineProcess, summary_ms
from benchmarks.gpu_floors import copy_floor, engine_phase_sums, http_round_trips, mark_version
from benchmarks.gpu_sync_report import PATHS, devices_info, sync_table, write_results

console = Console(width=140)


async def run_path(
    path: str, model, client, url: str, work: Path, args, start_version: int
) -> dict:
    """`args.updates` timed updates (after warm-ups) of one path; returns timings and checks."""
    import torch

    from shellrl.weights import disk as wtd
    from shellrl.weights import gpu as wtg
    from shellrl.weights.pinned import PinnedHostBucket

    learner = torch.device(args.learner_device)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    on_gpu = learner.type == "cuda"
    ipc = wtg.CudaIpcBucket(args.engine_device) if path in "abe" else None
    pinned = PinnedHostBucket() if path == "c" else None
    sync = None
    if path == "w":
        from services.learner.weights.weight_sync import WeightSync

        sync = WeightSync(
            client,
            None,
            transport="cuda_ipc" if on_gpu else "shm",
            deadline_s=300.0,
            sync_dir=work / "sync",
            engine_device=args.engine_device if on_gpu else None,
        )
    warmup = 1 if path == "d" else 3
    phases_before: dict = {}
    totals, servings, fills, updates, verifies = [], [], [], [], []
    version = start_version
    try:
        for i in range(warmup + args.updates):
            version += 1
            expected = mark_version(model, version)
            if on_gpu:
                torch.cuda.synchronize(learner)  # "optimizer step done"
            t0 = time.perf_counter()
            if path == "w":
                result = await sync.push(model, version)
                if not result.confirmed:
                    raise RuntimeError(f"WeightSync.push failed: {result.failed}")
                t1 = t2 = time.perf_counter()
            elif path == "d":
                directory = wtd.save_safetensors_dir(named, work / "disk" / f"v{version}").parent
                t1 = time.perf_counter()
                await client.update_weights_from_disk(
                    str(directory), weight_version=str(version), urls=[url]
                )
                t2 = time.perf_counter()
            else:  # as WeightSync does: the engine's session opens while the learner copies
                opening = asyncio.ensure_future(client.begin_weight_update(urls=[url]))
                if path == "c":
                    payload = await asyncio.to_thread(pinned.fill, named)
                else:  # enqueues the copies (sync=False): on the loop, no thread hop
                    await asyncio.sleep(0)  # let the begin request go out first
                    payload = ipc.fill(named, "direct" if path == "a" else "bucket", False)
                    if path == "e":  # what WeightSync sends: a fresh share in SGLang's envelope
                        (payload,) = ipc.entries(1)
                t1 = time.perf_counter()
                await opening
                await client.update_weights_from_tensor(
                    [payload],
                    weight_version=str(version),
                    session=False,
                    flush_cache=False,
                    urls=[url],
                )
                await client.end_weight_update(urls=[url])
                t2 = time.perf_counter()
            got = (await client.get_weight_version(urls=[url]))[url]
            t3 = time.perf_counter()
            if got != str(version):
                raise RuntimeError(
                    f"path {path}: engine reports version {got!r}, expected {version}"
                )
            if i == warmup - 1:
                phases_before = await engine_phase_sums(url)
            if path == "d" and version - 1 > start_version:
                shutil.rmtree(work / "disk" / f"v{version - 1}", ignore_errors=True)
            if i >= warmup:
                totals.append(t3 - t0)
                servings.append(t2 - t0)
                fills.append(t1 - t0)
                updates.append(t2 - t1)
                verifies.append(t3 - t2)
        phases_after = await engine_phase_sums(url)
        engine_phases_ms = {}
        for phase, (total_s, count) in phases_after.items():
            before_s, before_n = phases_before.get(phase, (0.0, 0.0))
            engine_phases_ms[phase] = 1e3 * (total_s - before_s) / max(1.0, count - before_n)
        async with httpx.AsyncClient(timeout=60.0) as http:
            served = (
                await http.post(
                    f"{url}/get_weights_by_name",
                    json={"name": "model.norm.weight", "truncate_size": 2},
                )
            ).json()
    finally:
        if pinned is not None:
            pinned.close()
        if ipc is not None:
            ipc.close()
        shutil.rmtree(work / "disk", ignore_errors=True)
    return {
        "path": path,
        "name": PATHS[path],
        "total": summary_ms(totals),
        "serving": summary_ms(servings),
        "learner_copy": summary_ms(fills),
        "engine_update": summary_ms(updates),
        "verify": summary_ms(verifies),
        "served_value_ok": abs(served[0] - expected) < 1e-6,
        "engine_phases_ms": engine_phases_ms,
        "last_version": version,
        "pinned": None if pinned is None else True,
    }


async def sync_section(shape: str, paths: str, args, results: dict, parity: bool) -> None:
    """Build the model, start the engine, time every path; run the parity section on the same engine."""
    import torch

    from benchmarks.model_shapes import save_random_model
    from shellrl.clients.engine import EngineClient
    from shellrl.weights import bucket as wt

    work = Path(args.work_dir) / shape
    shutil.rmtree(work, ignore_errors=True)
    dtype = torch.bfloat16 if args.learner_device.startswith("cuda") else torch.float32
    t0 = time.perf_counter()
    model = save_random_model(
        shape, work / "model", device=args.learner_device, dtype=dtype, logit_std=4.0
    )
    original_norm = model.model.norm.weight.detach().clone()
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    nbytes = wt.plan_bucket(named)[1]
    out = results.setdefault("sync", {}).setdefault(shape, {})
    out.update({"bytes": nbytes, "tensors": len(named), "build_s": time.perf_counter() - t0})
    console.print(
        f"[bold]{shape}[/]: {len(named)} tensors, {nbytes / 1e9:.3f} GB; built in {out['build_s']:.0f} s"
    )
    if args.learner_device.startswith("cuda") and args.engine_device.startswith("cuda"):
        out["floor"] = copy_floor(nbytes, args.learner_device, args.engine_device)
        out["floor_local"] = copy_floor(nbytes, args.engine_device, args.engine_device)
        console.print(
            f"  floor {out['floor']['median_ms']:.2f} ms ({out['floor']['gb_per_s']:.0f} GB/s)"
        )
    engine = EngineProcess(work / "model", args.engine_device, work / "engine.log")
    t0 = time.perf_counter()
    engine.start()
    out["engine_start_s"] = time.perf_counter() - t0
    client = EngineClient(engine.url, timeout_s=600.0)
    out["http_rtt"] = await http_round_trips(engine.url, client)
    console.print(
        "  HTTP round trips (median ms): "
        + ", ".join(f"{k} {v['median_ms']:.2f}" for k, v in out["http_rtt"].items())
    )
    version = 0
    try:
        for path in paths:
            try:
                r = await run_path(path, model, client, engine.url, work, args, version)
                version = r["last_version"]
                out[path] = r
                console.print(
                    f"  {path} {r['name']}: median {r['total']['median_ms']:.2f} ms, "
                    f"p90 {r['total']['p90_ms']:.2f} ms, served value ok={r['served_value_ok']}; engine "
                    "phases (mean ms) "
                    + ", ".join(f"{k} {v:.2f}" for k, v in r["engine_phases_ms"].items())
                )
            except Exception as exc:  # noqa: BLE001 - one path failing must not lose the others' numbers
                out[path] = {
                    "path": path,
                    "name": PATHS[path],
                    "error": f"{type(exc).__name__}: {exc}",
                    "engine_log": engine.tail(),
                }
                console.print(f"  [red]{path} failed: {exc}[/]")
                version += 1000
            write_results(results, args)
        with torch.no_grad():
            model.model.norm.weight.copy_(original_norm)
        if parity:
            from benchmarks.gpu_parity import parity_section

            try:
                results["parity"] = await parity_section(
                    model, client, engine.url, args, version + 1000
                )
            except Exception as exc:  # noqa: BLE001 - reported in the results, the rest still runs
                results["parity"] = {
                    "error": f"{type(exc).__name__}: {exc}",
                    "engine_log": engine.tail(),
                }
                console.print(f"  [red]parity failed: {exc}[/]")
            write_results(results, args)
    finally:
        await client.close()
        engine.stop()
        del model, named
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_gpu_weight_sync", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--learner-device", default="cuda:0")
    parser.add_argument("--engine-device", default="cuda:1")
    parser.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-7b")
    parser.add_argument(
        "--paths", default="abcdw", help="paths for the first shape (see the module docstring)"
    )
    parser.add_argument("--paths-large", default="abw", help="paths for the other shapes")
    parser.add_argument("--sections", default="sync,parity,memory")
    parser.add_argument(
        "--updates", type=int, default=20, help="timed updates per path (after warm-ups)"
    )
    parser.add_argument("--parity-prompts", type=int, default=40)
    parser.add_argument("--parity-new-tokens", type=int, default=256)
    parser.add_argument("--memory-shape", default="qwen2.5-0.5b")
    parser.add_argument(
        "--sizes-shapes", default="qwen2.5-0.5b,qwen2.5-7b", help="shapes of the sizes section"
    )
    parser.add_argument(
        "--bucket-mib", type=int, default=512, help="sizes: the streamed variant's bucket budget"
    )
    parser.add_argument(
        "--variants", default="stream,old", help="sizes: variants in order (gpu_push_sizes.py)"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="sizes: times the variants alternate per shape"
    )
    parser.add_argument("--work-dir", default="/tmp/shellrl-gpu-bench")
    parser.add_argument("--out", default="", help="directory for results.json and results.md")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Qwen2.5-0.5B's shape only, paths b and w, 2 updates, 2 parity prompts of 16 tokens "
        "(a smoke run)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.paths, args.updates = "qwen2.5-0.5b", "bw", 2
        args.parity_prompts, args.parity_new_tokens = 2, 16
    import torch

    needed = [
        torch.device(d) for d in (args.learner_device, args.engine_device) if d.startswith("cuda")
    ]
    if needed and torch.cuda.device_count() <= max(d.index or 0 for d in needed):
        console.print(
            f"bench_gpu_weight_sync: skipped (needs {args.learner_device} and {args.engine_device}; "
            f"this machine has {torch.cuda.device_count()} CUDA GPUs)"
        )
        return
    sections = set(args.sections.split(","))
    results: dict = {"devices": devices_info(), "args": vars(args)}
    shapes = [s for s in args.shapes.split(",") if s]
    started = time.perf_counter()
    for i, shape in enumerate(shapes):
        if "sync" in sections or ("parity" in sections and i == 0):
            asyncio.run(
                sync_section(
                    shape,
                    (args.paths if i == 0 else args.paths_large) if "sync" in sections else "",
                    args,
                    results,
                    parity="parity" in sections and i == 0,
                )
            )
    console.print(sync_table(results))
    if "parity" in results:
        from benchmarks.gpu_parity import parity_table

        console.print(parity_table(results["parity"]))
    if "sizes" in sections:
        from benchmarks.gpu_push_sizes import sizes_section, sizes_table

        sizes_section(args, results)
        console.print(sizes_table(results["sizes"]))
        write_results(results, args)
    if "memory" in sections:
        from benchmarks.gpu_memory import memory_section, memory_table

        try:
            results["memory"] = memory_section(args)
        except Exception as exc:  # noqa: BLE001 - reported in the results
            results["memory"] = {"error": f"{type(exc).__name__}: {exc}"}
        console.print(memory_table(results["memory"]))
    results["wall_s"] = time.perf_counter() - started
    write_results(results, args)


if __name__ == "__main__":
    main()
