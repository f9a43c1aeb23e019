"""Stream gauges (shellrl_stream_length{stream}, shellrl_stream_pending{stream,group},
shellrl_stream_lag{stream,group}) set by `export_stream_stats` against a real redis-server, and
exported by a real rollout process for the task stream it consumes and the episode backlog it watches."""

from __future__ import annotations

import asyncio
import functools

import httpx
from prometheus_client import REGISTRY

from shellrl.contract import Trajectory
from shellrl.service.aio import cancel_and_wait
from shellrl.streams import (
    GROUP_ROLLOUT,
    GROUP_VERIFIER,
    STREAM_EPISODES,
    STREAM_TASKS,
    OutgoingEntry,
    StreamConsumer,
    StreamProducer,
    connect,
    export_stream_stats,
)
from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port
from tests.helpers.waiting import wait_until_async

until = functools.partial(wait_until_async, timeout_s=5.0, what="the stream gauges", poll_s=0.02)


def gauges(stream: str, group: str) -> tuple[float | None, float | None, float | None]:
    """(length, pending, lag) as the process's Prometheus registry holds them."""
    return (
        REGISTRY.get_sample_value("shellrl_stream_length", {"stream": stream}),
        REGISTRY.get_sample_value("shellrl_stream_pending", {"stream": stream, "group": group}),
        REGISTRY.get_sample_value("shellrl_stream_lag", {"stream": stream, "group": group}),
    )


def entries(n: int, prefix: str) -> list[OutgoingEntry]:
    return [
        OutgoingEntry(Trajectory(trajectory_id=f"{prefix}{i}").SerializeToString())
        for i in range(n)
    ]


async def test_exporter_sets_every_watched_groups_gauges_and_refreshes_them(redis_server):
    redis = connect(redis_server.url)
    consumer = StreamConsumer(
        redis, STREAM_TASKS, GROUP_ROLLOUT, "r1", block_ms=50, count=2, claim_interval_s=3600
    )
    await consumer.ensure_group()
    await StreamProducer(redis, STREAM_TASKS).add_many(entries(5, "t"))
    read = await consumer.read()  # 2 delivered, not acknowledged
    await StreamProducer(redis, STREAM_EPISODES).add_many(entries(4, "e"))  # no verifier group yet
    exporter = asyncio.create_task(
        export_stream_stats(
            redis,
            [(STREAM_TASKS, GROUP_ROLLOUT), (STREAM_EPISODES, GROUP_VERIFIER)],
            interval_s=0.05,
        )
    )
    try:
        # one condition for both: a round sets the task gauges, then (after its own Redis calls)
        # the episode gauges, which until then hold what an earlier test of this process left
        await until(
            lambda: (
                gauges(STREAM_TASKS, GROUP_ROLLOUT) == (5, 2, 3)
                and gauges(STREAM_EPISODES, GROUP_VERIFIER) == (4, 0, 4)  # no group: all backlog
            )
        )
        await consumer.ack(*(e.entry_id for e in read))
        await StreamProducer(redis, STREAM_TASKS).add_many(entries(1, "u"))
        await until(lambda: gauges(STREAM_TASKS, GROUP_ROLLOUT) == (6, 0, 4))  # the next round
    finally:
        await cancel_and_wait(exporter)
        await redis.aclose()


async def test_exporter_survives_a_redis_outage_and_resumes(redis_server):
    redis = connect(redis_server.url)
    await StreamProducer(redis, STREAM_EPISODES).add_many(entries(2, "a"))
    exporter = asyncio.create_task(
        export_stream_stats(redis, [(STREAM_EPISODES, GROUP_VERIFIER)], interval_s=0.05)
    )
    try:
        await until(lambda: gauges(STREAM_EPISODES, GROUP_VERIFIER)[0] == 2)
        redis_server.stop()
        await asyncio.sleep(0.5)
        assert not exporter.done()
        assert gauges(STREAM_EPISODES, GROUP_VERIFIER) == (2, 0, 2)  # last values kept
        redis_server.start()
        await StreamProducer(redis, STREAM_EPISODES).add_many(entries(1, "b"))
        await until(lambda: gauges(STREAM_EPISODES, GROUP_VERIFIER) == (3, 0, 3))
    finally:
        await cancel_and_wait(exporter)
        await redis.aclose()


async def test_rollout_service_exports_its_task_stream_and_the_episode_backlog_it_watches(
    redis_server, tmp_path
):
    redis = connect(redis_server.url)
    await StreamProducer(redis, STREAM_EPISODES).add_many(entries(3, "e"))
    nowhere = f"http://127.0.0.1:{free_port()}"  # no engine, sandbox or verifier: no task is posted
    rollout = ServiceProcess(
        "rollout",
        free_port(),
        {
            "SHELLRL_REDIS_URL": redis_server.url,
            "SHELLRL_MODEL_PATH": "tiny",
            "SHELLRL_ENGINE_URLS": nowhere,
            "SHELLRL_SANDBOX_URL": nowhere,
            "SHELLRL_VERIFIER_URL": nowhere,
            "SHELLRL_LOG_LEVEL": "WARNING",
        },
        tmp_path,
    )
    try:
        rollout.start(ready_timeout_s=120)
        text = ""
        async with httpx.AsyncClient(base_url=rollout.url) as http:
            for _ in range(100):
                text = (await http.get("/metrics")).text
                if (
                    'shellrl_stream_lag{group="verifier",stream="shellrl:episodes"}' in text
                ):  # the round's last
                    break
                await asyncio.sleep(0.1)
        assert 'shellrl_stream_length{stream="shellrl:episodes"} 3.0' in text
        assert 'shellrl_stream_lag{group="verifier",stream="shellrl:episodes"} 3.0' in text
        assert 'shellrl_stream_pending{group="verifier",stream="shellrl:episodes"} 0.0' in text
        assert 'shellrl_stream_length{stream="shellrl:tasks"} 0.0' in text
        assert 'shellrl_stream_pending{group="rollout",stream="shellrl:tasks"} 0.0' in text
    finally:
        rollout.stop()
        await redis.aclose()
