"""Weight sync learner GPU -> engine GPU through the real engine process (issue 9): CUDA IPC with a
kept bucket (both stagings), the learner service's WeightSync.push, the pinned host path, and a
refused payload. Every check reads the engine's parameters back over HTTP."""

from __future__ import annotations

import json

import httpx
import pytest

from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_responses import EngineError
from shellrl.weights import gpu as wtg
from shellrl.weights.pinned import PinnedHostBucket
from tests.gpu.conftest import ENGINE_DEVICE, requires_cuda

torch = pytest.importorskip("torch")
pytestmark = requires_cuda

CHECKED = (
    "model.norm.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
)


def perturb(model, seed: int) -> None:
    """A new 'optimizer step': every checked tensor changes."""
    g = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(
                torch.randn(p.shape, generator=g, device=p.device, dtype=torch.float32).to(p.dtype)
                * 1e-2
            )


async def served(url: str, name: str, n: int = 100) -> torch.Tensor:
    async with httpx.AsyncClient(timeout=60.0) as http:
        r = await http.post(f"{url}/get_weights_by_name", json={"name": name, "truncate_size": n})
    r.raise_for_status()
    return torch.tensor(r.json())


async def assert_engine_serves(model, url: str, version: int) -> None:
    async with EngineClient(url) as client:
        assert (await client.get_weight_version(urls=[url]))[url] == str(version)
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in CHECKED:
        expected = params[name].detach().flatten()[:100].float().cpu()
        assert torch.equal(await served(url, name), expected), name


@pytest.mark.parametrize("staging", ["bucket", "direct"])
async def test_a_kept_cuda_ipc_bucket_delivers_every_new_version_to_the_engine(
    learner_model, gpu_engine, staging
):
    bucket = wtg.CudaIpcBucket(ENGINE_DEVICE)
    handles, payloads = set(), set()
    async with EngineClient(gpu_engine.url) as client:
        for step in range(3):
            perturb(learner_model, seed=step + (10 if staging == "direct" else 0))
            payload = bucket.fill(learner_model.named_parameters(), staging=staging)
            handles.add(json.loads(payload)["handle"]["handle"])
            payloads.add(payload)
            version = 100 + step + (10 if staging == "direct" else 0)
            await client.update_weights_from_tensor([payload], weight_version=str(version))
            await assert_engine_serves(learner_model, gpu_engine.url, version)
    bucket.close()
    assert len(handles) == 1  # the same buffer every time: the engine maps it once
    # the same string: the engine's fast path (no parse, no checks, no open)
    assert len(payloads) == 1


async def test_an_unsynchronized_fill_is_read_by_the_engine_only_after_its_copies_finished(
    learner_model, gpu_engine
):
    """fill(sync=False) returns while its copies are still queued, here behind a ~0.5 s GPU sleep on
    the learner's stream; the engine waits on the payload's ready event, so it stages the new values.
    Control: a refill's payload without `ready_event` is read at once and the engine serves stale
    values (the first payload of a bucket is covered by reduce_tensor's share-time event, a refill
    is not)."""
    bucket = wtg.CudaIpcBucket(ENGINE_DEVICE)
    params = dict(learner_model.named_parameters(remove_duplicate=False))
    name = "model.layers.0.self_attn.q_proj.weight"  # changed by perturb (norm.weight = 12.5 rounds it away)

    async def refill(seed: int) -> str:
        perturb(learner_model, seed=seed)
        with torch.cuda.device(learner_model.device):
            torch.cuda._sleep(1_000_000_000)  # every copy of the fill queues behind this
        return bucket.fill(learner_model.named_parameters(), sync=False)

    async with EngineClient(gpu_engine.url) as client:
        first = bucket.fill(learner_model.named_parameters(), sync=False)
        await client.update_weights_from_tensor([first], weight_version="598")
        payload = json.loads(await refill(60))
        assert "ready_event" in payload
        del payload["ready_event"]
        await client.update_weights_from_tensor([json.dumps(payload)], weight_version="599")
        expected = params[name].detach().flatten()[:100].float().cpu()
        assert not torch.equal(await served(gpu_engine.url, name), expected)  # the race exists
        for step in range(2):
            payload = await refill(61 + step)
            await client.update_weights_from_tensor([payload], weight_version=str(600 + step))
            await assert_engine_serves(learner_model, gpu_engine.url, 600 + step)
    bucket.close()


async def test_the_envelope_of_a_refilled_bucket_is_read_only_after_its_copies_finished(
    learner_model, gpu_engine
):
    """SGLang's envelope (what WeightSync sends over cuda_ipc): each `entries()` is a fresh share
    whose interprocess event is recorded after the fill's copies, queued here behind a ~0.5 s GPU
    sleep. The engine keeps the mapping between updates, so torch's cache skips its own event
    wait; shellrl's `rebuild_cuda_tensor_by_uuid` waits on it, and the engine serves the new
    values every time."""
    bucket = wtg.CudaIpcBucket(ENGINE_DEVICE)
    async with EngineClient(gpu_engine.url) as client:
        for step in range(3):
            perturb(learner_model, seed=70 + step)
            with torch.cuda.device(learner_model.device):
                torch.cuda._sleep(1_000_000_000)
            bucket.fill(learner_model.named_parameters(), sync=False)
            entries = bucket.entries(1)
            await client.update_weights_from_tensor(
                entries, load_format="flattened_bucket", weight_version=str(700 + step)
            )
            await assert_engine_serves(learner_model, gpu_engine.url, 700 + step)
    bucket.close()


SGLANG_READER = """
import base64, hashlib, json, sys
import torch
from tests.helpers import sglang_modules
sgl = sglang_modules.load()
from sglang.srt.utils import patch_torch
patch_torch.monkey_patch_torch_reductions()  # as SGLang's model runner does before any update
req = sgl.io_struct.UpdateWeightsFromTensorReqInput(
    serialized_named_tensors=json.load(sys.stdin), load_format="flattened_bucket"
)
obj = sgl.common.MultiprocessingSerializer.deserialize(
    base64.b64decode(req.serialized_named_tensors[0])
)
flat = obj["flattened_tensor"]
assert flat.is_cuda, flat.device
tensors = sgl.tensor_bucket.FlattenedTensorBucket(
    flattened_tensor=flat, metadata=obj["metadata"]
).reconstruct_tensors()
print(json.dumps({n: hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
                  .hexdigest() for n, t in tensors}))
"""


def test_sglangs_own_deserializer_in_another_process_reads_the_learners_cuda_bucket(
    learner_model,
):
    """The sglang wheel's MultiprocessingSerializer, SafeUnpickler, patch_torch and
    FlattenedTensorBucket (tests/helpers/sglang_modules.py) decode CudaIpcBucket.entries() in a
    second process: every tensor's bytes equal the learner's."""
    import hashlib
    import importlib.util
    import sys

    from tests.helpers.owned_processes import run_owned

    if importlib.util.find_spec("sglang") is None:  # its __init__ needs GPU packages: not imported
        pytest.skip("the sglang wheel is not installed")
    bucket = wtg.CudaIpcBucket(ENGINE_DEVICE)
    named = [(n, p.detach()) for n, p in learner_model.named_parameters()]
    bucket.fill(named)
    entries = bucket.entries(1)
    done = run_owned(
        [sys.executable, "-c", SGLANG_READER],
        input=json.dumps(entries),
        capture_output=True,
        text=True,
        timeout_s=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    expected = {
        n: hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
        for n, t in named
    }
    assert got == expected
    bucket.close()


async def test_weight_sync_push_over_cuda_ipc_is_served_by_the_engine(
    learner_model, gpu_engine, tmp_path
):
    from services.learner.weights.weight_sync import WeightSync

    async with EngineClient(gpu_engine.url) as client:
        sync = WeightSync(client, None, transport="cuda_ipc", deadline_s=120.0, sync_dir=tmp_path)
        for version in (200, 201):
            perturb(learner_model, seed=version)
            result = await sync.push(learner_model, version)
            assert result.confirmed == (gpu_engine.url,) and not result.failed
            await assert_engine_serves(learner_model, gpu_engine.url, version)


async def test_a_pinned_host_bucket_delivers_weights_to_a_gpu_engine(learner_model, gpu_engine):
    async with EngineClient(gpu_engine.url) as client:
        with PinnedHostBucket() as bucket:
            for version in (300, 301):
                perturb(learner_model, seed=version)
                payload = bucket.fill(learner_model.named_parameters())
                assert bucket.pinned
                await client.update_weights_from_tensor([payload], weight_version=str(version))
                await assert_engine_serves(learner_model, gpu_engine.url, version)


async def test_a_bucket_with_a_wrong_shape_is_refused_and_the_old_weights_stay_live(
    learner_model, gpu_engine
):
    bucket = wtg.CudaIpcBucket(ENGINE_DEVICE)
    async with EngineClient(gpu_engine.url) as client:
        await client.update_weights_from_tensor(
            [bucket.fill(learner_model.named_parameters())], weight_version="400"
        )
        payload = json.loads(bucket.fill(learner_model.named_parameters()))
        meta = payload["metadata"][0]
        assert meta["name"] == "model.embed_tokens.weight"
        meta["shape"] = [meta["shape"][0] // 2, meta["shape"][1] * 2]  # same bytes, wrong shape
        with pytest.raises(EngineError):
            await client.update_weights_from_tensor([json.dumps(payload)], weight_version="401")
    await assert_engine_serves(learner_model, gpu_engine.url, 400)
    bucket.close()
