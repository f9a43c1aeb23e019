"""Helpers for engine tests: start `python -m services.engine` on the tiny model, reference log-probs."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from tests.helpers.owned_processes import run_owned
from tests.helpers.processes import REPO, ServiceProcess
from tests.helpers.redis_server import free_port


@contextmanager
def running_engine(log_dir: Path, model_path: str = "tiny", **env: str):
    """A real engine process on a free port; stopped (by pid) on exit."""
    # One torch thread: on a small shared CI machine, OpenMP threads that spin-wait for each other
    # make every step many times slower as soon as another process competes for a core.
    settings = {
        "SHELLRL_MODEL_PATH": model_path,
        "SHELLRL_LOG_LEVEL": "WARNING",
        "SHELLRL_NUM_THREADS": "1",
        **env,
    }
    engine = ServiceProcess("engine", free_port(), settings, log_dir).start(ready_timeout_s=120)
    try:
        yield engine
    finally:
        engine.stop()


def reference_logprobs(
    cases: list[dict], work_dir: Path, model: str = "tiny", in_process: bool = False
) -> list[list[float]]:
    """Log-probs recomputed by plain transformers (tests/helpers/logprob_reference.py), in a separate
    process unless `in_process` (the engine is another process either way; this saves a start-up)."""
    if in_process:
        from tests.helpers.logprob_reference import compute

        return compute({"model": model, "cases": cases})
    source, target = Path(work_dir) / "reference_in.json", Path(work_dir) / "reference_out.json"
    source.write_text(json.dumps({"model": model, "cases": cases}))
    run_owned(
        [sys.executable, "-m", "tests.helpers.logprob_reference", str(source), str(target)],
        cwd=REPO,
        check=True,
        timeout_s=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return json.loads(target.read_text())


def perturbed(base: dict, seed: int) -> list:
    """`base` (name -> tensor) plus seeded noise of scale 0.05: distinct, valid weights for a push."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return [(n, t + 0.05 * torch.randn(t.shape, generator=generator)) for n, t in base.items()]


def engine_loads(url: str) -> dict:
    """The engine's `/v1/loads` entry: num_running_reqs, num_waiting_reqs, paused."""
    import httpx

    return httpx.get(f"{url}/v1/loads", timeout=10).json()["loads"][0]


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the Prometheus samples `name` whose labels include `labels` (0 when none)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def generated_tokens(url: str) -> float:
    """The engine's `shellrl_engine_generation_tokens_total`: tokens sampled since it started."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return metric_value(text, "shellrl_engine_generation_tokens_total")


async def wait_for_new_tokens(url: str, at_least: int = 2, timeout_s: float = 60.0) -> float:
    """Wait until the engine has sampled `at_least` more tokens than when this was called (its
    generation-token counter), instead of sleeping and hoping a busy machine decoded some; returns
    the count reached. AssertionError naming the wait after `timeout_s` seconds."""
    import asyncio

    from tests.helpers.waiting import wait_until_async

    start = await asyncio.to_thread(generated_tokens, url)

    async def grown() -> float:
        now = await asyncio.to_thread(generated_tokens, url)
        return now if now >= start + at_least else 0.0

    return await wait_until_async(
        grown, timeout_s, f"{at_least} more tokens sampled by {url}", poll_s=0.02
    )
