"""Streamed pushes into a real engine process (tiny model, issue 30 "streamed bounded buckets"):
the learner's `WeightSync` over shm without shared parameters splits the model into many small
buckets that pass through two slots; the weights arrive exactly, the engine reports the new
version only once the last bucket was loaded, the learner never holds more than two buckets, and
a bfloat16 engine gets bfloat16 buckets (exact), while a float32 engine is never cast down."""

from __future__ import annotations

import httpx
import pytest
import torch

from services.engine.bodies import MAX_TRUNCATE_SIZE
from services.learner.weights.weight_sync import WeightSync
from shellrl.models import load_model
from shellrl.weights import sglang as wsg
from tests.fakes.bucket_spy_client import BucketSpyClient
from tests.helpers.engine import running_engine

pytestmark = pytest.mark.slow
BUCKET_BYTES = 40_000  # the tiny model's 20 tensors in 11 buckets (its embedding alone)
CHECKED = (
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
)


async def served(url: str, name: str, numel: int) -> torch.Tensor:
    """The first `numel` values (at most MAX_TRUNCATE_SIZE) of the engine's parameter, float64."""
    async with httpx.AsyncClient(timeout=60) as http:
        got = await http.post(
            f"{url}/get_weights_by_name",
            json={"name": name, "truncate_size": min(numel, MAX_TRUNCATE_SIZE)},
        )
    got.raise_for_status()
    return torch.tensor(got.json(), dtype=torch.float64)


def first(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().double().flatten()[:MAX_TRUNCATE_SIZE]


def perturb(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=generator))


async def push_and_check(engine_url: str, tmp_path, model, version: int, **sync_args) -> dict:
    """Push `model` as `version` through a streamed shm WeightSync; returns what it observed."""
    async with BucketSpyClient([engine_url], timeout_s=120) as client:
        sync = WeightSync(
            client,
            None,
            transport="shm",
            deadline_s=60,
            sync_dir=tmp_path,
            bucket_bytes=BUCKET_BYTES,
            share_parameters=False,
            **sync_args,
        )
        try:
            result = await sync.push(model, version)
            assert result.confirmed == (engine_url,), result.failed
            return {
                "after_bucket": list(client.after_bucket),
                "stream": sync.staging.stream,
                "resident_bytes": sync.staging.resident_bytes,
                "push_dtype": sync.push_dtype,
                "phases": result.phases,
            }
        finally:
            sync.close()


async def test_a_multi_bucket_streamed_push_arrives_exactly_and_the_version_comes_with_the_last(
    tmp_path,
):
    model = load_model("tiny")
    perturb(model, 1)
    with running_engine(tmp_path) as engine:
        seen = await push_and_check(engine.url, tmp_path, model, 7)
        params = dict(model.named_parameters())
        for name in CHECKED:
            want = first(params[name])
            assert torch.equal(await served(engine.url, name, want.numel()), want), name
        stream, after = seen["stream"], seen["after_bucket"]
        assert len(stream.buckets) == 11 and len(after) == 11
        labels, reported = [a[1] for a in after], [a[2] for a in after]
        assert labels == [None] * 10 + ["7"]  # only the last bucket carries the version
        assert reported[:10] == ["default"] * 10  # buckets staged, nothing swapped in yet
        assert seen["push_dtype"] == "float32"  # a CPU engine serves float32: never cast down
        assert stream.filled_at_once <= 2
        largest = max(t.nbytes for _, t in model.named_parameters())
        assert 0 < stream.peak_resident_bytes <= 2 * BUCKET_BYTES + largest
        assert "fill" in seen["phases"]


async def test_a_bfloat16_engine_gets_bfloat16_buckets_that_arrive_exactly(tmp_path):
    model = load_model("tiny")
    perturb(model, 2)
    with running_engine(tmp_path, SHELLRL_DTYPE="bfloat16") as engine:
        async with httpx.AsyncClient(timeout=30) as http:
            info = (await http.get(f"{engine.url}/server_info")).json()
        assert info["dtype"] == "bfloat16"  # the dtype it serves in, not the setting's "auto"
        seen = await push_and_check(engine.url, tmp_path, model, 3)
        assert seen["push_dtype"] == "bfloat16"
        params = dict(model.named_parameters())
        for name in CHECKED:
            want = first(params[name].to(torch.bfloat16))
            assert torch.equal(await served(engine.url, name, want.numel()), want), name
        largest_bf16 = max(t.numel() * 2 for _, t in model.named_parameters())
        assert seen["stream"].peak_resident_bytes <= 2 * BUCKET_BYTES + largest_bf16


async def test_a_bfloat16_bucket_into_a_float32_engine_is_cast_up_exactly(tmp_path):
    """The engine's side of a cast: a bucket in bfloat16 into a float32 model is copied with a
    cast (exact), the engine says so once in its log."""
    from shellrl.clients.engine import EngineClient

    model = load_model("tiny")
    perturb(model, 3)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    with running_engine(tmp_path) as engine:
        async with EngineClient([engine.url], timeout_s=120) as client:
            bucket = wsg.SharedTensorBucket(named, dtype=torch.bfloat16)
            try:
                await client.begin_weight_update()
                await client.update_weights_from_tensor(
                    bucket.entries(1), weight_version="bf16", session=False
                )
                await client.end_weight_update()
            finally:
                bucket.close()
            for name in CHECKED:
                want = first(dict(named)[name].to(torch.bfloat16))
                assert torch.equal(await served(engine.url, name, want.numel()), want), name
        assert "cast while copying" in engine.tail(20_000)
