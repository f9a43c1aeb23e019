"""A second learner pushing at once (issue 30, bad input) into a real engine process (tiny
model). On one stream a second learner never starts (the learner lock:
tests/service/test_learner_data_parallel.py::
test_a_second_learner_on_the_same_stream_refuses_to_start_naming_the_holder). Here two learners'
WeightSyncs reach the same engine anyway (say, two stacks sharing it): while the first push is
between two buckets, the second is refused by the engine (its weight-update session is open) and
takes the engine out of its own rotation; the first push completes, and the engine serves exactly
the first learner's weights under its version, never a mix of the two."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from services.engine.bodies import MAX_TRUNCATE_SIZE
from services.learner.weights.weight_sync import WeightSync
from shellrl.clients.engine import EngineClient
from shellrl.models import load_model
from tests.fakes.gated_bucket_client import GatedBucketClient
from tests.helpers.engine import running_engine

pytestmark = pytest.mark.slow
BUCKET_BYTES = 40_000  # the tiny model's 20 tensors in 11 buckets
CHECKED = ("model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "model.norm.weight")


def sync_for(client: EngineClient, tmp_path) -> WeightSync:
    return WeightSync(
        client,
        None,
        transport="shm",
        deadline_s=60,
        sync_dir=tmp_path,
        bucket_bytes=BUCKET_BYTES,
        share_parameters=False,
        pause_mode="off",
    )


def perturbed(seed: int) -> torch.nn.Module:
    model = load_model("tiny")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=generator))
    return model


async def assert_serves(url: str, model: torch.nn.Module) -> None:
    """The engine at `url` serves `model`'s weights exactly (CHECKED tensors, first
    MAX_TRUNCATE_SIZE values: the same float32 values pushed and read back, no other path)."""
    params = dict(model.named_parameters())
    for name in CHECKED:
        want = params[name].detach().double().flatten()[:MAX_TRUNCATE_SIZE]
        assert torch.equal(await served(url, name), want), name


async def served(url: str, name: str) -> torch.Tensor:
    async with httpx.AsyncClient(timeout=60) as http:
        got = await http.post(
            f"{url}/get_weights_by_name", json={"name": name, "truncate_size": MAX_TRUNCATE_SIZE}
        )
    got.raise_for_status()
    return torch.tensor(got.json(), dtype=torch.float64)


async def test_a_second_learner_pushing_at_once_is_refused_and_the_first_push_lands_whole(
    tmp_path,
):
    first_model, second_model = perturbed(1), perturbed(2)
    with running_engine(tmp_path) as engine:
        async with (
            GatedBucketClient([engine.url], timeout_s=60, after=2) as gated,
            EngineClient([engine.url], timeout_s=60) as other,
        ):
            first, second = sync_for(gated, tmp_path / "a"), sync_for(other, tmp_path / "b")
            try:
                pushing = asyncio.ensure_future(first.push(first_model, 1))
                await asyncio.wait_for(gated.between_buckets.wait(), 60)
                refused = await asyncio.wait_for(second.push(second_model, 7), 60)
                assert refused.confirmed == () and not refused.published
                assert "weight-update session is already open" in refused.failed[engine.url]
                assert not second.engines[engine.url].in_rotation
                assert not pushing.done()  # the first push waited, untouched, between buckets

                gated.release.set()
                landed = await asyncio.wait_for(pushing, 60)
                assert landed.confirmed == (engine.url,), landed.failed
                assert gated.calls == 11  # every bucket of the first push
            finally:
                gated.release.set()
                await first.aclose()
                await second.aclose()
            assert (await other.get_weight_version())[engine.url] == "1"
            await assert_serves(engine.url, first_model)


async def test_a_restarted_learner_ends_the_session_its_killed_predecessor_left_open(tmp_path):
    """A learner SIGKILLed between two buckets leaves its weight-update session open on the
    engine (no process is left to end it; the raw /begin_weight_update below is what its push
    had sent). A new process's pushes are then refused ("a weight-update session is already
    open") and the engine leaves its rotation: in a chaos run versions 9 and 10 stayed unpublished
    for 16 s and admission stalled. The restarted learner (`LearnerWorker.resume` from a
    checkpoint) first ends the stale session; its push then lands whole and is published."""
    model = perturbed(3)
    with running_engine(tmp_path) as engine:
        async with EngineClient([engine.url], timeout_s=60) as client:
            async with httpx.AsyncClient(timeout=60) as http:
                opened = await http.post(f"{engine.url}/begin_weight_update", json={})
            assert opened.json()["success"] is True  # the killed learner's session
            without, restarted = sync_for(client, tmp_path / "a"), sync_for(client, tmp_path / "b")
            try:
                refused = await asyncio.wait_for(without.push(model, 9), 60)
                assert "weight-update session is already open" in refused.failed[engine.url]
                assert not without.engines[engine.url].in_rotation

                await restarted.end_stale_sessions()
                landed = await asyncio.wait_for(restarted.push(model, 9), 60)
                assert landed.confirmed == (engine.url,), landed.failed
                assert restarted.engines[engine.url].in_rotation
            finally:
                await without.aclose()
                await restarted.aclose()
            assert (await client.get_weight_version())[engine.url] == "9"
            await assert_serves(engine.url, model)
