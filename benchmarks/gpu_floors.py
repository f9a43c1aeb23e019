"""Floors and probes of the GPU weight-sync benchmarks (benchmarks/bench_gpu_weight_sync.py,
gpu_push_sizes.py): the raw device-to-device copy every path is measured against (`copy_floor`),
HTTP round trips to the engine (`http_round_trips`), the engine's own update phases from its
/metrics (`engine_phase_sums`), and a value only one version has (`mark_version`).
"""

from __future__ import annotations

import time

import httpx

from benchmarks.gpu_common import summary_ms


def copy_floor(nbytes: int, src_device: str, dst_device: str, repeats: int = 20) -> dict:
    """Raw copy of `nbytes` from src to dst (both preallocated): the lower bound of any path."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=src_device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
    samples = []
    for i in range(repeats + 3):
        for d in {src.device, dst.device}:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        dst.copy_(src)
        for d in {src.device, dst.device}:
            torch.cuda.synchronize(d)
        if i >= 3:
            samples.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    out = summary_ms(samples)
    out["gb_per_s"] = nbytes / (out["median_ms"] / 1e3) / 1e9
    return out


async def http_round_trips(url: str, client=None, repeats: int = 30) -> dict:
    """Median HTTP round trips to the engine (keep-alive connection): the floor of every update call.
    GETs of /healthz and /model_info with plain httpx; an empty weight-update session (POST
    begin_weight_update + POST end_weight_update, nothing staged) with plain httpx and with the
    project's EngineClient `client` (its overhead over plain httpx is the difference)."""
    out = {}

    async def timed(name: str, call) -> None:
        samples = []
        for i in range(repeats + 3):
            t0 = time.perf_counter()
            await call()
            if i >= 3:
                samples.append(time.perf_counter() - t0)
        out[name] = summary_ms(samples)

    async with httpx.AsyncClient(timeout=30.0) as http:
        for path in ("healthz", "model_info"):
            await timed(path, lambda: _get_ok(http, f"{url}/{path}"))

        async def raw_session():
            (
                await http.post(f"{url}/begin_weight_update", json={"selector": "all"})
            ).raise_for_status()
            (await http.post(f"{url}/end_weight_update", json={})).raise_for_status()

        await timed("begin+end (httpx)", raw_session)
    if client is not None:

        async def client_session():
            await client.begin_weight_update(urls=[url])
            await client.end_weight_update(urls=[url])

        await timed("begin+end (EngineClient)", client_session)
    return out


async def _get_ok(http, url: str) -> None:
    (await http.get(url)).raise_for_status()


async def engine_phase_sums(url: str) -> dict[str, tuple[float, float]]:
    """{phase: (sum seconds, count)} of shellrl_engine_weight_update_phase_seconds from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=30.0) as http:
        text = (await http.get(f"{url}/metrics")).text
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "shellrl_engine_weight_update_phase_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith(("_sum", "_count")):
                out.setdefault(sample.labels["phase"], [0.0, 0.0])[
                    sample.name.endswith("_count")
                ] = sample.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def mark_version(model, version: int) -> float:
    """Write a value only this version has into the model, exact in bfloat16 (outside the timed
    region); returns it."""
    import torch

    with torch.no_grad():
        model.model.norm.weight[0] = float(version % 200)
    return float(version % 200)
