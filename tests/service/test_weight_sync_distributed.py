"""The learner's distributed transport (WeightSync, gloo) against a real engine process (tiny
model): pushes land; an engine that never joins, freezes mid-update or dies is reported within
the deadline and taken out of rotation, never a hang, and a thawed one comes back."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import torch

from services.learner.weights.weight_sync import WeightSync
from shellrl.clients.engine import EngineClient
from shellrl.models import load_model
from tests.helpers.engine import metric_value, running_engine

pytestmark = pytest.mark.slow
DEADLINE_S = 4.0


def step(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3)


async def test_gloo_pushes_and_an_engine_that_never_joins_freezes_or_dies_is_reported_within_the_deadline(
    tmp_path,
):
    model = load_model("tiny")
    with running_engine(tmp_path) as engine:
        client = EngineClient([engine.url], timeout_s=DEADLINE_S, connect_retries=1)
        sync = WeightSync(
            client,
            None,
            transport="distributed",
            deadline_s=DEADLINE_S,
            sync_dir=tmp_path,
            retry_interval_s=0.5,
            share_parameters=True,
        )
        try:
            engine.signal(signal.SIGSTOP)  # frozen before the group exists: it never joins
            started = time.monotonic()
            result = await sync.push(model, 1)
            assert time.monotonic() - started < DEADLINE_S + 20  # without it: minutes
            assert result.failed[engine.url].startswith("deadline") and not result.published
            engine.signal(signal.SIGCONT)

            for version in (2, 3):  # back: a new group, full updates
                step(model)
                deadline = time.monotonic() + 30
                while (
                    sync.engines[engine.url].version != str(version) and time.monotonic() < deadline
                ):
                    if sync.engines[engine.url].in_rotation:
                        await sync.push(model, version)
                    else:
                        await sync.reconcile(model, version)
                        await asyncio.sleep(0.2)  # the background health probe runs meanwhile
                assert sync.engines[engine.url].version == str(version)
            expected = (
                dict(model.named_parameters())["model.embed_tokens.weight"].detach().flatten()[:20]
            )
            got = (
                await client._request(
                    "POST",
                    engine.url,
                    "/get_weights_by_name",
                    json={"name": "model.embed_tokens.weight", "truncate_size": 20},
                )
            ).json()
            assert torch.equal(torch.tensor(got), expected)

            engine.signal(signal.SIGSTOP)  # frozen with a live group
            step(model)
            started = time.monotonic()
            result = await sync.push(model, 4)
            assert time.monotonic() - started < DEADLINE_S + 20  # without it: minutes
            assert result.failed[engine.url].startswith("deadline")
            assert not sync.engines[engine.url].in_rotation
            engine.signal(signal.SIGCONT)

            engine.kill()  # dead: refused at once
            deadline = time.monotonic() + 30
            while (
                sync.engines[engine.url].last_error.startswith("deadline")
                and time.monotonic() < deadline
            ):
                sync.engines[engine.url].in_rotation = True  # as if it had come back, then died
                result = await sync.push(model, 5)
                await asyncio.sleep(0.2)
            assert "EngineUnavailable" in sync.engines[engine.url].last_error
        finally:
            engine.signal(signal.SIGCONT)
            sync.close()
            await client.close()


def _open_groups(url: str) -> float:
    """The engine's `shellrl_engine_weight_update_groups`: its live weight-update groups."""
    import httpx

    return metric_value(
        httpx.get(f"{url}/metrics", timeout=10).text, "shellrl_engine_weight_update_groups"
    )


async def test_a_group_the_learner_closes_is_destroyed_on_the_engine_and_a_new_one_joins(tmp_path):
    """Issue 30: the engine's group used to stay open after the learner closed its side, until
    the next group. Now the learner's aclose (its shutdown) and forget (an engine taken out,
    engine_membership's leave, a failed push) have the engine destroy it
    (/destroy_weights_update_group, through shellrl.process_groups.leave on both sides): the
    engine reports no open group, a new group joins and pushes afterwards, and the engine ends
    cleanly (no "terminate called without an active exception")."""
    model = load_model("tiny")
    with running_engine(tmp_path) as engine:
        client = EngineClient([engine.url], timeout_s=30, connect_retries=1)

        def new_sync() -> WeightSync:
            return WeightSync(
                client,
                None,
                transport="distributed",
                deadline_s=30,
                sync_dir=tmp_path,
                share_parameters=True,
            )

        sync = new_sync()
        started = time.monotonic()
        try:
            assert _open_groups(engine.url) == 0
            assert (await sync.push(model, 1)).confirmed == (engine.url,)
            assert _open_groups(engine.url) == 1
            await sync.aclose()  # the learner's shutdown
            assert _open_groups(engine.url) == 0

            sync = new_sync()  # a learner started again: a second group initialises
            step(model)
            assert (await sync.push(model, 2)).confirmed == (engine.url,)
            assert _open_groups(engine.url) == 1
            sync.groups.forget(engine.url)  # the engine taken out: destroyed in the background
            deadline = time.monotonic() + 15
            while _open_groups(engine.url) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert _open_groups(engine.url) == 0
            step(model)
            assert (await sync.push(model, 3)).confirmed == (engine.url,)  # a third group
            assert _open_groups(engine.url) == 1
            await sync.aclose()
            assert _open_groups(engine.url) == 0
            assert time.monotonic() - started < 60  # 5 s on 2 busy cores (load 10)
        finally:
            sync.close()
            await client.close()
        code = engine.stop()
        log = engine.log_path.read_text(errors="replace")
    # SIGTERM: the engine dies of the signal it handled (-15); an abort would be -6 (SIGABRT)
    assert code in (0, -signal.SIGTERM) and "terminate called" not in log, (code, log[-3000:])
