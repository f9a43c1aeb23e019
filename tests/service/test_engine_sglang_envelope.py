"""shellrl's engine as a drop-in for SGLang's weight updates (issue 16), real engine process (tiny
model): SGLang's envelope for /update_weights_from_tensor, the distributed path (gloo) with the
learner's own group code, and bad input answered 400 naming the field while the old weights keep
serving and nothing stays mapped or joined."""

from __future__ import annotations

import base64
import os
import pickle
from pathlib import Path

import httpx
import pytest
import torch

from services.learner.weights.engine_groups import EngineGroups
from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_responses import EngineError
from shellrl.models import load_model
from shellrl.weights import distributed as wdist
from shellrl.weights import sglang as wsg
from tests.helpers.engine import perturbed, running_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running_engine(tmp_path_factory.mktemp("engine")) as process:
        yield process


@pytest.fixture(scope="module")
def base_weights() -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in load_model("tiny").named_parameters()}


@pytest.fixture
async def client(engine):
    async with EngineClient([engine.url], timeout_s=120) as c:
        yield c


async def served(client: EngineClient, engine, name: str) -> torch.Tensor:
    async with httpx.AsyncClient(timeout=30) as http:
        got = (
            await http.post(
                f"{engine.url}/get_weights_by_name", json={"name": name, "truncate_size": 50}
            )
        ).json()
    return torch.tensor(got)


def first(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.flatten()[:50].float()


def torch_shm_mapped(pid: int) -> set[str]:
    return {
        line.split()[-1]
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
        if "/torch_" in line
    }


async def test_an_envelope_push_goes_live_and_the_engine_keeps_one_mapping(
    engine, client, base_weights
):
    named = perturbed(base_weights, 1)
    with wsg.SharedTensorBucket(named) as bucket:
        for step, version in enumerate(("e1", "e2")):
            bucket.refill([(n, t + step) for n, t in named])
            await client.update_weights_from_tensor(bucket.entries(1), weight_version=version)
            assert (await client.get_weight_version())[engine.url] == version
            name, tensor = named[0]
            assert torch.equal(await served(client, engine, name), first(tensor + step))
        assert torch_shm_mapped(engine.proc.pid) == {f"/dev/shm{bucket.shm_handle}"}


async def test_a_pickle_that_would_run_a_command_gets_400_and_runs_nothing(
    engine, client, base_weights, tmp_path
):
    class RunsACommand:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'ran'}",)

    name = next(iter(base_weights))
    before = await served(client, engine, name)
    entry = base64.b64encode(pickle.dumps(RunsACommand())).decode()
    with pytest.raises(EngineError, match="blocked global") as info:
        await client.update_weights_from_tensor([entry], weight_version="never")
    assert info.value.status == 400 and not (tmp_path / "ran").exists()
    assert torch.equal(await served(client, engine, name), before)


def _bad_payloads(named):
    """(mutation of a good envelope push, the field the 400 must name)."""

    def entries_of(obj):
        return [wsg.to_entry(wsg.serialize(obj))]

    def with_meta(**change):
        buffer, metadata = torch.cat([t.flatten().view(torch.uint8) for _, t in named]), []
        offset = 0
        for n, t in named:
            nbytes = t.numel() * t.element_size()
            metadata.append(
                wsg.FlattenedTensorMetadata(n, t.shape, t.dtype, offset, offset + nbytes, nbytes)
            )
            offset += nbytes
        last = metadata[-1]
        for key, value in change.items():
            setattr(last, key, value(last) if callable(value) else value)
        return entries_of({"flattened_tensor": buffer, "metadata": metadata})

    return [
        (lambda: with_meta() * 2, "serialized_named_tensors: expected 1 entry"),
        (lambda: ["{}not base64"], "load_format|JSON"),
        (
            lambda: ["bm90IGJhc2U2NA=="[:-1] + "!"],
            r"serialized_named_tensors\[0\]: expected base64",
        ),
        (
            lambda: with_meta(start_idx=lambda m: m.start_idx + 8, end_idx=lambda m: m.end_idx + 8),
            r"metadata\[\d+\].end_idx: .*overrun",
        ),
        (lambda: with_meta(dtype=torch.complex64), r"metadata\[\d+\].dtype: unsupported dtype"),
        (lambda: with_meta(name="no.such.parameter"), "unknown parameter name"),
    ]


async def test_bad_envelopes_get_400_naming_the_field_old_weights_serve_and_nothing_stays_mapped(
    engine, client, base_weights
):
    named = perturbed(base_weights, 2)
    name = named[0][0]
    before = await served(client, engine, name)
    mapped = torch_shm_mapped(engine.proc.pid)
    for make, message in _bad_payloads(named):
        with pytest.raises(EngineError, match=message) as info:
            await client.update_weights_from_tensor(make(), weight_version="never")
        assert info.value.status == 400
        assert torch.equal(await served(client, engine, name), before)
        assert (await client.get_weight_version())[engine.url] != "never"
    assert torch_shm_mapped(engine.proc.pid) <= mapped  # every refused bucket was unmapped


async def test_a_gloo_group_pushes_weights_and_bad_group_requests_get_400(
    engine, client, base_weights
):
    groups = EngineGroups(client, backend="gloo", timeout_s=30)
    group = await groups.group(engine.url, tp_size=1)
    try:
        named = perturbed(base_weights, 3)
        flat = wdist.FlatBucket(named, "cpu")
        await client.begin_weight_update()
        await groups.broadcast(
            engine.url,
            group,
            flat.tensor,
            client.update_weights_from_distributed(
                **wdist.request_fields(named), group_name=group.name, weight_version="d1"
            ),
        )
        await client.end_weight_update()
        assert (await client.get_weight_version())[engine.url] == "d1"
        assert torch.equal(await served(client, engine, named[0][0]), first(named[0][1]))

        async def refused(path: str, body: dict, field: str) -> None:
            async with httpx.AsyncClient(timeout=30) as http:
                answer = await http.post(f"{engine.url}{path}", json=body)
            assert answer.status_code == 400 and field in answer.json()["message"], answer.text

        init = {
            "master_address": "127.0.0.1",
            "master_port": group.port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": group.name,
            "backend": "gloo",
        }
        await refused("/init_weights_update_group", init, "group_name: a group named")  # live name
        await refused(
            "/init_weights_update_group",
            init | {"group_name": "other", "world_size": 1},
            "world_size",
        )
        await refused(
            "/init_weights_update_group",
            init | {"group_name": "other", "backend": "nccl"},
            "backend",
        )
        await client.begin_weight_update()
        await refused(
            "/update_weights_from_distributed",
            {
                **wdist.request_fields(named),
                "group_name": "nope",
                "load_format": "flattened_bucket",
            },
            "group_name: no live group",
        )
        with pytest.raises(
            EngineError, match="session discarded"
        ):  # nothing of that session applies
            await client.end_weight_update()
        await refused("/destroy_weights_update_group", {"group_name": "nope"}, "group_name")
        assert (await client.get_weight_version())[engine.url] == "d1"
    finally:
        groups.close()
    await client.destroy_weights_update_group(group.name)  # the engine leaves it
    with pytest.raises(EngineError):
        await client.destroy_weights_update_group(group.name)
