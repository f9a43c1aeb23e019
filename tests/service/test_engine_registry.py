"""Several engines through the registry shellrl:engines, with real engine processes (tiny model),
real Redis, and the learner's and gateway's engine sides in process (tests/helpers/engine_fleet.py;
the same classes their services run): an engine that joins mid-run, one that is killed and
restarted (issue 15 fault 8), one that leaves (drained), and one serving another model (refused).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from services.engine.registration import EngineRegistrar
from services.rollout import metrics as rollout_metrics
from shellrl.clients.engine_registry import read_registrations, read_sync
from tests.helpers.engine import running_engine
from tests.helpers.engine_fleet import GatewaySide, LearnerSide, registering_engine, run_episode
from tests.helpers.owned_processes import popen_owned, stop_owned
from tests.helpers.processes import REPO
from tests.helpers.waiting import wait_until_async

pytestmark = pytest.mark.slow
PROMPT = [1, 9690, 28, 253, 1061, 30]
ENGINE_ENV = {"SHELLRL_SHUTDOWN_GRACE_S": "2"}


def failovers(reason: str) -> float:
    return rollout_metrics.ENGINE_FAILOVERS.labels(reason)._value.get()


def start_sidecar(engine_url: str, redis_url: str) -> subprocess.Popen:
    """The registration sidecar (as beside an SGLang server) for an engine that does not register."""
    return popen_owned(
        [sys.executable, "-m", "services.engine.registration", "--engine-url", engine_url]
        + ["--model-path", "tiny", "--redis-url", redis_url, "--heartbeat-s", "0.3"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def test_joined_restarted_and_leaving_engines_take_traffic_only_with_current_weights(
    redis_server, tmp_path
):
    redis_url = redis_server.url
    a = registering_engine(redis_url, tmp_path, **ENGINE_ENV)  # registers itself
    plain = running_engine(tmp_path, **ENGINE_ENV)  # b: joins later through the sidecar
    with ThreadPoolExecutor(2) as pool:
        started = [pool.submit(a.start, 120), pool.submit(plain.__enter__)]
        b = started[1].result()
        started[0].result()
    learner = LearnerSide(redis_url, tmp_path / "sync")
    gateway = GatewaySide(redis_url)
    answers, stop = [], asyncio.Event()

    async def traffic(worker: int) -> None:  # pinned episodes back to back
        n = 0
        while not stop.is_set():
            await run_episode(gateway, PROMPT, 4, f"w{worker}-e{n}", sink=answers)
            n += 1

    async def served_by(url: str, since: int) -> bool:
        return any(x.engine == url for x in answers[since:])

    stale_before = failovers("stale")
    loops = [
        asyncio.create_task(learner.run(stop)),
        asyncio.create_task(gateway.watcher.run()),
        asyncio.create_task(gateway.directory.run(stop)),
    ]
    sidecar = None
    try:
        for _ in range(3):  # version 3 published with engine a alone: base weights are stale now
            await learner.step()
        await wait_until_async(lambda: gateway.current() == 3, 30, "version 3 published")
        workers = [asyncio.create_task(traffic(w)) for w in range(4)]
        await wait_until_async(lambda: len(answers) >= 8, 60, "traffic on engine a")
        assert {x.engine for x in answers} == {a.url}

        # join: b registers mid-run, gets a full push of the current version, then traffic
        sidecar = start_sidecar(b.url, redis_url)
        mark = len(answers)
        await wait_until_async(lambda: served_by(b.url, mark), 60, "traffic on the joined b")
        first_b = next(x for x in answers[mark:] if x.engine == b.url)
        assert first_b.version >= 3 and first_b.current - first_b.version <= 1
        assert (await read_sync(learner.redis))[b.url].instance is not None

        # fault 8: a is killed mid-run (its pinned episodes move to b), the learner steps on, a
        # restarts serving its initial weights: it takes traffic only once it has the current one
        moved_before = failovers("unreachable") + failovers("not_routable")
        await wait_until_async(
            lambda: gateway.client.routing.in_flight[a.url] > 0, 30, "a request on a", 0.001
        )
        a.kill()  # that request fails: its episode moves to b
        await learner.step()
        await learner.step()  # version 5: the restarted a's base weights are 5 versions behind
        await wait_until_async(lambda: gateway.current() == 5, 30, "version 5 published")
        restarted_at = len(answers)
        await asyncio.to_thread(a.start, 120)
        await wait_until_async(lambda: served_by(a.url, restarted_at), 60, "traffic on restarted a")
        first_a = next(x for x in answers[restarted_at:] if x.engine == a.url)
        assert first_a.version == 5, first_a
        assert failovers("unreachable") + failovers("not_routable") > moved_before

        # leave: SIGTERM to a drains it; no new traffic goes there, then its entry is gone
        a.signal(signal.SIGTERM)
        await wait_until_async(
            lambda: _no_registration(learner, a.url), 30, "a's registration deleted"
        )
        left_at = len(answers)
        await wait_until_async(lambda: len(answers) >= left_at + 8, 60, "traffic after a left")
        assert {x.engine for x in answers[left_at:]} == {b.url}
        await wait_until_async(lambda: a.url not in learner.sync.engines, 30, "learner drops a")

        stop.set()
        await asyncio.gather(*workers)
    finally:
        stop.set()
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        if sidecar is not None:
            stop_owned(sidecar, grace_s=15)
        await learner.close()
        await gateway.close()
        a.stop()
        plain.__exit__(None, None, None)
    # no episode kept an answer sampled outside the staleness bound, and the gateway never even
    # sent a request to an engine outside it (no answer had to be discarded as stale)
    outside = [x for x in answers if x.current - x.version > 1]
    assert not outside, outside[:5]
    assert failovers("stale") == stale_before


async def _no_registration(learner: LearnerSide, url: str) -> bool:
    return url not in await read_registrations(learner.redis)


async def test_an_engine_serving_another_model_is_refused_and_the_refusal_names_it(
    redis_server, tmp_path, caplog
):
    learner = LearnerSide(redis_server.url, tmp_path / "sync")
    gateway = GatewaySide(redis_server.url)
    smollm2 = {  # SmolLM2-135M's config: the engine at `url` serves it, the learner trains tiny
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    }
    url = "http://127.0.0.1:9"

    async def running() -> str:
        return "up"

    registrar = EngineRegistrar(
        learner.redis, url, "smollm2", smollm2, heartbeat_s=0.2, state=running
    )
    caplog.set_level(logging.INFO)
    try:
        await registrar.beat()
        await learner.sync.membership.refresh()
        sync = (await read_sync(learner.redis))[url]
        assert sync.refused and not sync.in_rotation
        for text in (url, "'smollm2'", "30 layers", "'tiny'", "2 layers"):
            assert text in sync.refused
        assert url not in learner.sync.engines and url not in learner.client.urls
        assert sync.refused in caplog.text  # the learner's log names it
        await gateway.directory.refresh()
        assert not gateway.client.routing.is_routable(url)
        assert gateway.directory.why_not[url] == sync.refused
        await registrar.beat()  # the engine's own log says it was refused
        assert f"the learner refused this engine: {sync.refused}" in caplog.text
    finally:
        await registrar.close()
        await learner.close()
        await gateway.close()


async def test_a_seed_engine_that_restarted_is_out_of_rotation_until_updated(
    redis_server, tmp_path
):
    """A seed engine (SHELLRL_ENGINE_URLS, no registration) that now reports its initial weights
    while the learner had confirmed version 5 was restarted: the learner takes it out of rotation
    (so its next reconcile gives it a full update) and the gateway stops routing to it. A FAKE
    engine (its /model_info) plays the restarted one."""
    from services.learner.weights.engine_rotation import write_engine_states
    from tests.fakes.fake_engine import ScriptedEngine, serve_in_thread

    fake = ScriptedEngine(lambda body: None, weight_version="default")
    server = serve_in_thread(fake.app())
    learner = LearnerSide(redis_server.url, tmp_path / "sync", seeds=[server.url])
    gateway = GatewaySide(redis_server.url, seeds=[server.url])
    try:
        state = learner.sync.engines[server.url]
        state.version, state.last_ok_at = "5", 1.0  # as after the push of version 5
        await write_engine_states(learner.redis, learner.sync.engines)
        await gateway.directory.refresh()
        assert gateway.client.routing.is_routable(server.url)
        membership = learner.sync.membership
        membership.refresh_s = 0.0

        async def taken_out() -> bool:  # a refresh reads the served version in the background;
            await membership.refresh()  # a later one finds "default" where 5 was confirmed
            return not state.in_rotation

        await wait_until_async(taken_out, 10, "the restarted engine out of rotation")
        assert "serves weight_version default, confirmed 5" in state.last_error
        assert state.last_probe_s == 0.0  # reconcile probes it at once, then updates it in full
        await gateway.directory.refresh()
        assert not gateway.client.routing.is_routable(server.url)
        assert gateway.directory.why_not[server.url] == "out of the learner's rotation"
    finally:
        await learner.close()
        await gateway.close()
        server.stop()
