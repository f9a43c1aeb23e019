"""known_pitfalls D01 against a real engine process (tiny model): the learner's push with
`pause_mode="retract"` (pause -> begin -> update through SGLang's envelope -> end -> continue)
aborts none of the requests it retracted; they finish with their tokens labelled by version."""

from __future__ import annotations

import asyncio

import pytest

from services.learner.weights.weight_sync import WeightSync
from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_responses import EngineError
from shellrl.models import load_model
from tests.helpers.engine import engine_loads, running_engine, wait_for_new_tokens

pytestmark = pytest.mark.slow
LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 1.0}


async def test_a_retract_paused_push_aborts_nothing_and_labels_tokens_by_version(tmp_path):
    model = load_model("tiny")
    with running_engine(tmp_path) as engine:
        async with EngineClient([engine.url], timeout_s=120) as client:
            sync = WeightSync(
                client,
                None,
                transport="shm",
                deadline_s=60,
                sync_dir=tmp_path,
                pause_mode="retract",
                share_parameters=True,
            )
            try:
                running = [
                    asyncio.ensure_future(client.generate([1, 2, 3 + i], LONG, rid=f"d01-{i}"))
                    for i in range(4)
                ]
                for _ in range(200):
                    if engine_loads(engine.url)["num_running_reqs"] >= 4:
                        break
                    await asyncio.sleep(0.05)
                await wait_for_new_tokens(engine.url)  # some tokens on the first weights
                result = await sync.push(model, 1)
                assert result.confirmed == (engine.url,), result.failed
                done = await asyncio.gather(*running)
                assert [r.finish_reason for r in done] == ["length"] * 4  # 0 of 4 aborted
                for r in done:
                    assert len(r.output_ids) == 400
                    assert [s.version for s in r.weight_versions][-1] == "1"
                # tokens before the push carry the engine's first version ("default"), after it "1"
                assert any(r.weight_versions[0].version != "1" for r in done)
                assert (await client.get_weight_version())[engine.url] == "1"
                assert not engine_loads(engine.url).get("paused")
            finally:
                sync.close()


async def test_the_default_push_never_waits_for_a_long_generation_in_flight(tmp_path):
    """issue 30 items 4 and 6: the default pause (auto: in place for shellrl's engine) commits at
    once; unpaused, the engine would commit only after this 8,000-token generation ended. The
    generation goes on, its later tokens labelled with the new version."""
    model = load_model("tiny")
    with running_engine(tmp_path) as engine:
        async with EngineClient([engine.url], timeout_s=600) as client:
            sync = WeightSync(
                client,
                None,
                transport="shm",
                deadline_s=60,
                sync_dir=tmp_path,
                share_parameters=True,
            )
            params = {"max_new_tokens": 8000, "ignore_eos": True, "temperature": 1.0}
            try:
                long = asyncio.ensure_future(client.generate([1, 2, 3], params, rid="long-0"))
                for _ in range(200):
                    if engine_loads(engine.url)["num_running_reqs"] >= 1:
                        break
                    await asyncio.sleep(0.05)
                await wait_for_new_tokens(engine.url)  # some tokens on the first weights
                result = await sync.push(model, 1)
                assert result.confirmed == (engine.url,), result.failed
                assert not long.done()  # the push did not wait for it
                assert (await client.get_weight_version())[engine.url] == "1"
                await wait_for_new_tokens(engine.url)  # some tokens on the new weights
                await client.abort_request("long-0")
                done = await long
                versions = [s.version for s in done.weight_versions]
                assert versions[0] != "1" and versions[-1] == "1", versions
                assert len(done.output_ids) < 8000
            finally:
                if not long.done():
                    long.cancel()
                sync.close()


class PauseRefusedClient(EngineClient):
    """Fault injection (a fake, named so): the real client, except that pause_generation answers
    HTTP 503 a moment after it was sent, while the push's buckets are being staged beside it."""

    async def pause_generation(self, mode="abort", *, urls=None):
        await asyncio.sleep(0.2)
        raise EngineError(next(iter(urls)), 503, {"error": "injected: pause refused"})


async def test_a_refused_pause_beside_the_transfer_loads_nothing_and_leaves_no_session(tmp_path):
    """shellrl's engine stages buckets while its pause is in flight (engine_load.load_paused); a
    pause that fails must not let the staged buckets go live unpaused: the session is discarded,
    the engine keeps its version and is not left paused, and the next push succeeds."""
    model = load_model("tiny")
    with running_engine(tmp_path) as engine:
        async with PauseRefusedClient([engine.url], timeout_s=120) as client:
            sync = WeightSync(client, None, transport="shm", deadline_s=60, sync_dir=tmp_path)
            try:
                before = (await client.get_weight_version())[engine.url]
                result = await sync.push(model, 1)
                assert result.confirmed == () and "injected" in result.failed[engine.url]
                assert (await client.get_weight_version())[engine.url] == before
                assert not engine_loads(engine.url).get("paused")
                await client.begin_weight_update()  # no session was left open
                await client.end_weight_update(discard=True)
            finally:
                sync.close()
        async with EngineClient([engine.url], timeout_s=120) as client:
            sync = WeightSync(client, None, transport="shm", deadline_s=60, sync_dir=tmp_path)
            try:
                result = await sync.push(model, 2)
                assert result.confirmed == (engine.url,), result.failed
                assert {"pause", "transfer", "load", "continue"} <= set(result.phases)
                assert (await client.get_weight_version())[engine.url] == "2"
            finally:
                sync.close()
