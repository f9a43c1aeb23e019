"""A push interrupted mid-way (issue 30, bad input) against a real engine process (tiny model),
over streamed shm and over gloo-distributed: the learner's push is cancelled between two buckets
(what the learner's shutdown does when its drain runs out: cancel_and_wait on the worker, then
`WeightSync.aclose`). The engine keeps serving the version it had (label, weights, a generation
labelled with it), the learner leaves no shared-memory segment of its own in /dev/shm, no
weight-update group stays open on the engine, and no weight-update session either: a learner
started again pushes at once."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest
import torch

from services.engine.bodies import MAX_TRUNCATE_SIZE
from services.learner.weights.weight_sync import WeightSync
from shellrl.clients.engine import EngineClient
from shellrl.models import load_model
from tests.fakes.gated_bucket_client import GatedBucketClient
from tests.helpers.engine import metric_value, running_engine

pytestmark = pytest.mark.slow
BUCKET_BYTES = 40_000  # the tiny model's 20 tensors in 11 buckets
INTERRUPTED_AFTER = 3  # buckets the engine received before the push is cancelled
CHECKED = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight")


def own_segments() -> set[str]:
    """This process's torch file-system shared memory in /dev/shm (torch_<pid>_...)."""
    return {p.name for p in Path("/dev/shm").glob(f"torch_{os.getpid()}_*")}


async def served(url: str, name: str) -> torch.Tensor:
    async with httpx.AsyncClient(timeout=60) as http:
        got = await http.post(
            f"{url}/get_weights_by_name", json={"name": name, "truncate_size": MAX_TRUNCATE_SIZE}
        )
    got.raise_for_status()
    return torch.tensor(got.json(), dtype=torch.float64)


def open_groups(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return metric_value(text, "shellrl_engine_weight_update_groups")


def sync_for(client: EngineClient, transport: str, tmp_path: Path) -> WeightSync:
    return WeightSync(
        client,
        None,
        transport=transport,
        deadline_s=60,
        sync_dir=tmp_path,
        bucket_bytes=BUCKET_BYTES,
        share_parameters=False,
        pause_mode="off",
    )


def step(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=generator))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One engine for both transports (each test reads what it serves first)."""
    with running_engine(tmp_path_factory.mktemp("engine")) as engine:
        yield engine


@pytest.mark.parametrize("transport", ["shm", "distributed"])
async def test_a_push_cancelled_between_buckets_leaves_the_old_version_serving_and_nothing_open(
    transport, engine, tmp_path
):
    model = load_model("tiny")
    before = own_segments()
    async with EngineClient([engine.url], timeout_s=60) as plain:
        serving = (await plain.get_weight_version())[engine.url]  # "default", or the other test's
    kept = {name: (await served(engine.url, name)) for name in CHECKED}
    version = int(serving) + 1 if serving.isdigit() else 1
    step(model, version)

    async with GatedBucketClient([engine.url], timeout_s=60, after=INTERRUPTED_AFTER) as cut:
        sync = sync_for(cut, transport, tmp_path)
        push = asyncio.ensure_future(sync.push(model, version))
        try:
            await asyncio.wait_for(cut.between_buckets.wait(), 60)
            assert not push.done()
            push.cancel()  # the learner's shutdown: cancel_and_wait, then aclose
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(push, 20)
        finally:
            await asyncio.wait_for(sync.aclose(), 30)
        assert cut.calls == INTERRUPTED_AFTER  # no bucket sent after the interruption

    async with EngineClient([engine.url], timeout_s=60) as plain:
        assert (await plain.get_weight_version())[engine.url] == serving
        for name in CHECKED:
            assert torch.equal(await served(engine.url, name), kept[name]), name
        out = await plain.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 1.0})
        assert {s.version for s in out.weight_versions} == {serving}
        assert open_groups(engine.url) == 0
        assert own_segments() <= before, own_segments() - before

        again = sync_for(plain, transport, tmp_path)  # the learner started again
        try:
            result = await again.push(model, version)
            assert result.confirmed == (engine.url,), result.failed
        finally:
            await again.aclose()
        assert (await plain.get_weight_version())[engine.url] == str(version)
        params = dict(model.named_parameters())
        for name in CHECKED:
            want = params[name].detach().double().flatten()[:MAX_TRUNCATE_SIZE]
            assert torch.equal(await served(engine.url, name), want), name
        assert open_groups(engine.url) == 0
    assert own_segments() <= before, own_segments() - before
