"""The learner logs every step's metrics to the experiment tracker (issue 22, item 1), its resolved
settings and a table of sampled episodes (issue 34, item 1): a real learner process (tiny model)
against real Redis and a real engine trains two steps with `SHELLRL_TRACKER=tensorboard`
(installed with the dev extras); its event files are read back with TensorBoard's own reader."""

from __future__ import annotations

import json

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
from tests.unit.test_tracking import read_tensorboard, read_texts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not installed("tensorboard"), reason="tensorboard not installed"),
]


async def test_learner_logs_every_step_to_tensorboard(engine, redis_server, tmp_path):  # noqa: F811
    redis = streams.connect(redis_server.url)
    client = EngineClient([engine.url], timeout_s=120)
    learner = ServiceProcess(
        "learner",
        free_port(),
        learner_env(
            redis_server.url, engine.url, tmp_path, tracker="tensorboard", sample_table_rows=2
        ),
        tmp_path,
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
    run = tmp_path / "tracking" / "learner"
    config = json.loads((run / "config.json").read_text())
    assert config["tracker"] == "tensorboard" and config["sample_table_rows"] == 2
    assert config["checkpoint_dir"] == str(tmp_path / "ckpt") and "lr" in config
    ((step, text),) = read_texts(run, "config")
    assert step == 0 and json.loads(text.removeprefix("```json\n").removesuffix("\n```")) == config
    tables = read_texts(run, "samples")
    assert [step for step, _ in tables] == [1, 2]
    header, _, *rows = tables[0][1].splitlines()
    assert header.split(" | ")[:3] == ["| group_id", "task_id", "training_reward"]
    assert len(rows) == 2 and rows[0].startswith("| g1 |")
    assert (tmp_path / "tracking" / "run_name").read_text().startswith("shellrl-")


async def _version_is(client: EngineClient, url: str, version: str) -> bool:
    return (await client.get_weight_version()) == {url: version}
