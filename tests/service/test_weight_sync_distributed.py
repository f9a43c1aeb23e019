"""The learner's distributed transport (WeightSync, gloo) against a real engine process (tiny
model): pushes land; an engine that never joins, freezes mid-update or dies is reported within
the deadline and taken out of rotation, never a hang, and a thawed one comes back."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import torch

from services.learner.weight_sync import WeightSync
from shellrl.clients.engine import EngineClient
from shellrl.models import load_model
from tests.helpers.engine import running_engine

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
