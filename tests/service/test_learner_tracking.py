"""The learner logs every step's metrics to the experiment tracker (issue 22, item 1): a real
learner process (tiny model) against real Redis and a real engine trains two steps with the default
backend (TensorBoard, installed with the dev extras); its event files are read back with
TensorBoard's own reader."""

from __future__ import annotations

import pytest

from shellrl import streams
from shellrl.clients.engine import EngineClient
from shellrl.tracking import installed
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port
from tests.helpers.waiting import wait_until_async
from tests.service.test_learner import (  # noqa: F401 (engine: a module fixture)
    add_group,
    engine,
    learner_env,
    step_reaches,
)
from tests.unit.test_tracking import read_tensorboard

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not installed("tensorboard"), reason="tensorboard not installed"),
]


async def test_learner_logs_every_step_to_tensorboard(engine, redis_server, tmp_path):  # noqa: F811
    redis = streams.connect(redis_server.url)
    client = EngineClient([engine.url], timeout_s=120)
    learner = ServiceProcess(
        "learner", free_port(), learner_env(redis_server.url, engine.url, tmp_path), tmp_path
    )
    try:
        learner.start(ready_timeout_s=120)
        await add_group(redis, client, "g1")
        await step_reaches(learner, 1)
        # sample g2 on version 1 (the push follows the step): its staleness is then 0, not 1
        await wait_until_async(
            lambda: _version_is(client, engine.url, "1"), what="the engine serving version 1"
        )
        await add_group(redis, client, "g2")
        last = (await step_reaches(learner, 2))["last_step"]
    finally:
        learner.stop()  # SIGTERM: the last checkpoint, then the tracker is closed
        await client.close()
        await redis.aclose()
    scalars, _ = read_tensorboard(tmp_path / "tracking" / "learner")
    for tag in (
        "reward_mean",
        "success_rate",
        "loss",
        "kl",
        "grad_norm",
        "lr",
        "tokens_per_second",
        "seconds",
        "parity_mean",
        "parity_max",
        "staleness_mean",
        "staleness_max",
        "zero_variance_fraction",
        "outcomes/trained",
        "stats/clip_fraction_low",
        "stats/clip_fraction_high",
        "stats/is_weight_mean",
        "stats/is_truncated_fraction",
        "rss_bytes",
    ):
        assert [step for step, _ in scalars[tag]] == [1, 2], tag
    assert scalars["reward_mean"][1][1] == pytest.approx(last["reward_mean"])
    assert scalars["loss"][1][1] == pytest.approx(last["loss"], rel=1e-6, abs=1e-9)
    assert scalars["staleness_max"] == [
        (1, 0.0),
        (2, 0.0),
    ]  # each group sampled by the version it trained


async def _version_is(client: EngineClient, url: str, version: str) -> bool:
    return (await client.get_weight_version()) == {url: version}
