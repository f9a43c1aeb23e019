"""The report of benchmarks/bench_gpu_weight_sync.py: the paths it measures (`PATHS`), the
end-to-end table (`sync_table`), results.json and results.md under --out (`write_results`, with
the parity, memory and push-size tables when they ran), and the machine (`devices_info`).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

PATHS = {
    "a": "per-tensor copies + CUDA IPC",
    "b": "bucket, one copy + CUDA IPC",
    "e": "bucket + CUDA IPC in SGLang's envelope",
    "c": "host-staged pinned shm",
    "d": "safetensors on disk",
    "w": "WeightSync.push (learner service)",
}


def sync_table(results: dict) -> Table:
    table = Table(
        title="Weight sync, end to end (optimizer step done -> engine serves the new version)"
    )
    for col in (
        "model",
        "path",
        "median ms",
        "p90 ms",
        "x floor",
        "serving ms",
        "learner copy ms",
        "engine update ms",
        "verify ms",
        "n",
    ):
        table.add_column(col, justify="right" if col != "path" else "left")
    for shape, out in results.get("sync", {}).items():
        floor = out.get("floor", {}).get("median_ms")
        if floor:
            table.add_row(
                shape,
                f"floor: raw copy {out['bytes'] / 1e9:.2f} GB "
                f"({out['floor']['gb_per_s']:.0f} GB/s)",
                f"{floor:.2f}",
                f"{out['floor']['p90_ms']:.2f}",
                "1.00",
                "",
                "",
                "",
                "",
                str(out["floor"]["n"]),
            )
        for name, rtt in out.get("http_rtt", {}).items():
            table.add_row(
                shape,
                f"HTTP round trip: {name}",
                f"{rtt['median_ms']:.2f}",
                f"{rtt['p90_ms']:.2f}",
                "",
                "",
                "",
                "",
                "",
                str(rtt["n"]),
            )
        for path in PATHS:
            r = out.get(path)
            if r is None:
                continue
            if "error" in r:
                table.add_row(
                    shape, f"{path} {r['name']}", "failed", r["error"][:60], "", "", "", "", "", ""
                )
                continue
            t = r["total"]
            table.add_row(
                shape,
                f"{path} {r['name']}",
                f"{t['median_ms']:.2f}",
                f"{t['p90_ms']:.2f}",
                f"{t['median_ms'] / floor:.2f}" if floor else "-",
                f"{r['serving']['median_ms']:.2f}" if "serving" in r else "-",
                f"{r['learner_copy']['median_ms']:.2f}",
                f"{r['engine_update']['median_ms']:.2f}",
                f"{r['verify']['median_ms']:.2f}",
                str(t["n"]),
            )
    return table


def write_results(results: dict, args) -> None:
    if not args.out:
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    record = Console(record=True, width=160, file=io.StringIO())
    record.print(sync_table(results))
    if "parity" in results:
        from benchmarks.gpu_parity import parity_table

        record.print(parity_table(results["parity"]))
    if "memory" in results:
        from benchmarks.gpu_memory import memory_table

        record.print(memory_table(results["memory"]))
    if "sizes" in results:
        from benchmarks.gpu_push_sizes import sizes_table

        record.print(sizes_table(results["sizes"]))
    (out / "results.md").write_text(record.export_text())


def devices_info() -> dict:
    """torch, CUDA, the GPUs and their peer access, transformers: the machine of a run."""
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpus": []}
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        info["gpus"].append(
            {"index": i, "name": p.name, "memory_gb": round(p.total_memory / 2**30, 1)}
        )
    if torch.cuda.device_count() >= 2:
        info["peer_access_0_1"] = torch.cuda.can_device_access_peer(0, 1)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info
