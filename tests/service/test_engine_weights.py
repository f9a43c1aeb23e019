"""Weight updates of a real engine process (tiny model) while it serves: versions per token, parity
with the new weights, pause modes, and refused updates that leave the old weights serving."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_responses import EngineError, VersionSpan
from shellrl.models import load_model
from shellrl.weights import disk as wtd
from shellrl.weights import shm
from tests.helpers.engine import (
    perturbed,
    reference_logprobs,
    running_engine,
    wait_for_new_tokens,
)

PARITY_TOLERANCE = 1e-4
PROMPT = [101, 2045, 331, 17, 9000, 42, 7, 7, 512]
LONG = {"max_new_tokens": 5000, "ignore_eos": True, "temperature": 1.0, "sampling_seed": 11}


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


async def push(client: EngineClient, named, version: str) -> None:
    """What the learner does on CPU: a shared-memory flattened bucket, unlinked after the call."""
    with shm.SharedMemoryBucket(named) as bucket:
        await client.update_weights_from_tensor([bucket.payload()], weight_version=version)


async def wait_for_tokens(engine_url: str, minimum_running: int = 1) -> None:
    async with httpx.AsyncClient() as http:
        for _ in range(200):
            loads = (await http.get(f"{engine_url}/v1/loads")).json()["loads"][0]
            if loads["num_running_reqs"] >= minimum_running:
                await wait_for_new_tokens(engine_url)  # some tokens on the weights of now
                return
            await asyncio.sleep(0.05)
    raise AssertionError("request never started running")


async def test_retract_pause_and_update_mid_generation_labels_tokens_and_matches_both_weight_sets(
    engine, client, base_weights, tmp_path
):
    weights_a, weights_b = perturbed(base_weights, 1), perturbed(base_weights, 2)
    wtd.save_safetensors_dir(weights_a, tmp_path / "a")
    wtd.save_safetensors_dir(weights_b, tmp_path / "b")
    await push(client, weights_a, "a")
    task = asyncio.create_task(client.generate(PROMPT, LONG, rid="retracted"))
    await wait_for_tokens(engine.url)
    await client.pause_generation("retract")
    await push(client, weights_b, "b")
    await client.continue_generation()
    await wait_for_new_tokens(engine.url)  # some tokens on the new weights
    await client.abort_request("retracted")
    result = await asyncio.wait_for(task, 60)

    assert result.finish_reason == "abort" and len(result.output_ids) == len(result.output_logprobs)
    (old, new) = result.weight_versions
    assert old.version == "a" and new.version == "b" and old.start == 0 and old.end == new.start
    assert (
        new.end == len(result.output_ids) and 0 < old.end < new.end and result.weight_version == "b"
    )
    k = old.end
    expected = reference_logprobs(
        [
            {
                "prompt": PROMPT,
                "output": result.output_ids[:k],
                "temperature": 1.0,
                "weights_dir": str(tmp_path / "a"),
            },
            {
                "prompt": PROMPT + result.output_ids[:k],
                "output": result.output_ids[k:],
                "temperature": 1.0,
                "weights_dir": str(tmp_path / "b"),
            },
        ],
        tmp_path,
        in_process=True,
    )
    got = [result.output_logprobs[:k], result.output_logprobs[k:]]
    worst = max(abs(x - y) for g, e in zip(got, expected) for x, y in zip(g, e))
    assert worst <= PARITY_TOLERANCE, f"max |engine - reference| = {worst}"


async def test_abort_pause_returns_partial_old_version_tokens_and_the_resumed_turn_runs_on_new_weights(
    engine, client, base_weights
):
    await push(client, perturbed(base_weights, 3), "c")
    task = asyncio.create_task(client.generate(PROMPT, LONG))
    await wait_for_tokens(engine.url)
    await client.pause_generation("abort")
    partial = await asyncio.wait_for(task, 30)
    await push(client, perturbed(base_weights, 4), "d")
    await client.continue_generation()
    assert partial.finish_reason == "abort" and partial.output_ids
    assert partial.weight_versions == (VersionSpan("c", 0, len(partial.output_ids)),)
    resumed = await client.generate(
        PROMPT + partial.output_ids, {"max_new_tokens": 4, "temperature": 0}
    )
    assert resumed.weight_version == "d" and resumed.weight_versions == (VersionSpan("d", 0, 4),)
    assert resumed.cached_tokens == 0, "the prefix cache must be flushed by a weight update"


async def test_update_without_pause_waits_for_running_requests_which_finish_on_the_old_version(
    engine, client, base_weights
):
    await push(client, perturbed(base_weights, 5), "e")
    task = asyncio.create_task(client.generate(PROMPT, {**LONG, "max_new_tokens": 150}))
    await wait_for_tokens(engine.url)
    await push(client, perturbed(base_weights, 6), "f")
    finished = await asyncio.wait_for(task, 60)
    assert finished.finish_reason == "length" and finished.weight_versions == (
        VersionSpan("e", 0, 150),
    )
    after = await client.generate(PROMPT, {"max_new_tokens": 2})
    assert after.weight_version == "f" and (await client.get_weight_version()) == {engine.url: "f"}


async def test_in_place_pause_keeps_the_request_and_labels_later_tokens_with_the_new_version(
    engine, client, base_weights
):
    await push(client, perturbed(base_weights, 7), "g")
    task = asyncio.create_task(client.generate(PROMPT, LONG, rid="kept"))
    await wait_for_tokens(engine.url)
    await client.pause_generation("in_place")
    await push(client, perturbed(base_weights, 8), "h")
    await client.continue_generation()
    await wait_for_new_tokens(engine.url)  # some tokens on the new weights
    await client.abort_request("kept")
    result = await asyncio.wait_for(task, 30)
    assert [span.version for span in result.weight_versions] == ["g", "h"]
    assert result.weight_versions[-1].end == len(result.output_ids) == len(result.output_logprobs)


async def test_disk_update_serves_logprobs_of_the_checkpoint(
    engine, client, base_weights, tmp_path
):
    weights = perturbed(base_weights, 9)
    wtd.save_safetensors_dir(weights, tmp_path / "ckpt")
    await client.update_weights_from_disk(str(tmp_path / "ckpt"), "disk-1")
    result = await client.generate(
        PROMPT, {"max_new_tokens": 12, "temperature": 0.7, "ignore_eos": True}
    )
    assert result.weight_version == "disk-1"
    (expected,) = reference_logprobs(
        [
            {
                "prompt": PROMPT,
                "output": result.output_ids,
                "temperature": 0.7,
                "weights_dir": str(tmp_path / "ckpt"),
            }
        ],
        tmp_path,
        in_process=True,
    )
    assert max(abs(x - y) for x, y in zip(result.output_logprobs, expected)) <= PARITY_TOLERANCE


async def test_every_update_observes_its_stage_and_commit_phases_in_metrics(
    engine, client, base_weights
):
    def counts(text: str) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        return {
            s.labels["phase"]: s.value
            for f in text_string_to_metric_families(text)
            if f.name == "shellrl_engine_weight_update_phase_seconds"
            for s in f.samples
            if s.name.endswith("_count")
        }

    async with httpx.AsyncClient() as http:
        before = counts((await http.get(f"{engine.url}/metrics")).text)
        await push(client, perturbed(base_weights, 21), "phases-1")
        after = counts((await http.get(f"{engine.url}/metrics")).text)
    assert {p: after[p] - before.get(p, 0.0) for p in after} == {
        "stage": 1,
        "stage_hop": 1,
        "commit": 1,
        "commit_hop": 1,
    }


async def _snapshot(engine_url: str, client: EngineClient) -> dict:
    """What the engine serves: a weight read back, greedy tokens and their log-probs, the version.

    The prefix cache is flushed first so every snapshot runs the same compute path (a full
    prefill). Without it the second snapshot reuses the first one's cached prefix and prefills
    fewer tokens: other matmul shapes, other float rounding (the CI flake at 5456081 differed at
    the 6th decimal: -8.685486793518066 vs -8.68548583984375).
    """
    async with httpx.AsyncClient() as http:
        weights = (
            await http.post(
                f"{engine_url}/get_weights_by_name",
                json={"name": "model.layers.0.mlp.up_proj.weight", "truncate_size": 20},
            )
        ).json()
    await client.flush_cache()  # EngineError if refused
    greedy = await client.generate(
        PROMPT, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    )
    assert greedy.cached_tokens == 0, "snapshots compare full prefills only"
    return {
        "weights": weights,
        "output_ids": greedy.output_ids,
        "logprobs": greedy.output_logprobs,
        "weight_version": greedy.weight_version,
    }


def assert_same_serving(after: dict, before: dict) -> None:
    """The old weights still serve: the stored weight is read back bit for bit (one code path) and
    the version and greedy tokens are equal; log-probs of two forward passes agree within
    PARITY_TOLERANCE (floats from two runs are never compared bit for bit)."""
    assert (
        after["weights"] == before["weights"]
        and after["weight_version"] == before["weight_version"]
    )
    assert after["output_ids"] == before["output_ids"]
    worst = max(abs(x - y) for x, y in zip(after["logprobs"], before["logprobs"], strict=True))
    assert worst <= PARITY_TOLERANCE, f"max |after - before| = {worst}"


@pytest.mark.parametrize(
    "mutate,message",
    [
        (
            lambda named: named[:3] + [("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))],
            "shape",
        ),
        (
            lambda named: named + [("model.layers.99.mlp.up_proj.weight", torch.zeros(2))],
            "unknown parameter",
        ),
    ],
)
async def test_refused_tensor_update_gives_400_and_old_weights_keep_serving(
    engine, client, base_weights, mutate, message
):
    before = await _snapshot(engine.url, client)
    with pytest.raises(EngineError, match=message) as info:
        await push(client, mutate(perturbed(base_weights, 10)), "never")
    assert info.value.status == 400
    assert_same_serving(await _snapshot(engine.url, client), before)


async def test_tensor_update_outside_a_session_and_pickled_payloads_are_refused(
    engine, client, base_weights
):
    before = await _snapshot(engine.url, client)
    with shm.SharedMemoryBucket(perturbed(base_weights, 11)) as bucket:
        body = {
            "serialized_named_tensors": [bucket.payload()],
            "load_format": "flattened_bucket",
            "weight_version": "x",
        }
        outside = httpx.post(f"{engine.url}/update_weights_from_tensor", json=body, timeout=30)
    assert (
        outside.status_code == 400
        and "between begin_weight_update() and end_weight_update()" in outside.json()["message"]
    )
    with pytest.raises(EngineError, match="never unpickled"):
        await client.update_weights_from_tensor(["gASVAAAA"], weight_version="x")
    with pytest.raises(EngineError, match="load_format"):
        await client.update_weights_from_tensor(
            [json.dumps({"transport": "shm"})], weight_version="x", load_format=None
        )
    with pytest.raises(EngineError, match="no .*safetensors"):
        await client.update_weights_from_disk("/nonexistent", "x")
    gguf = httpx.post(
        f"{engine.url}/update_weights_from_disk",
        json={"model_path": "/x", "load_format": "gguf"},
        timeout=30,
    )
    assert (
        gguf.status_code == 400 and "load_format 'gguf' is not supported" in gguf.json()["message"]
    )
    assert_same_serving(await _snapshot(engine.url, client), before)


async def test_a_push_the_engine_refuses_closes_its_session_so_the_next_update_can_open_one(
    engine, client, tmp_path
):
    from services.learner.weights.weight_sync import WeightSync

    model = load_model("tiny")
    model.register_parameter("not_in_the_engine", torch.nn.Parameter(torch.zeros(2)))
    sync = WeightSync(client, None, transport="shm", deadline_s=60.0, sync_dir=tmp_path)
    try:
        result = await sync.push(model, 901)
        assert not result.confirmed and "unknown parameter" in result.failed[engine.url]
        await client.begin_weight_update()  # 400 "already open" before the fix
        await client.end_weight_update()
    finally:
        sync.close()


async def test_a_session_ended_with_discard_puts_nothing_live_and_the_next_one_opens(
    engine, client, base_weights
):
    """shellrl's `discard` on /end_weight_update (a push its learner abandoned mid-way, issue 30):
    the staged bucket never goes live, neither its weights nor its version, and the session is
    closed; a plain end of the next session puts its bucket live."""
    before = await _snapshot(engine.url, client)
    await client.begin_weight_update()
    with shm.SharedMemoryBucket(perturbed(base_weights, 12)) as bucket:
        await client.update_weights_from_tensor(
            [bucket.payload()], weight_version="discarded", session=False
        )
    assert (await client.end_weight_update(discard=True)) == {engine.url: True}
    assert_same_serving(await _snapshot(engine.url, client), before)
    assert (await client.get_weight_version())[engine.url] != "discarded"
    await push(client, perturbed(base_weights, 13), "after-discard")  # begin, bucket, end
    assert (await client.get_weight_version())[engine.url] == "after-discard"
