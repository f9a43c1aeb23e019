"""The control-plane benchmark's latency fakes (tests/fakes/fake_latency.py) serve only routes of
the real engine and sandbox, and draw latencies inside the recorded distribution."""

from __future__ import annotations

import random
import re

from benchmarks.control_plane_profile import build_profile, histogram, read_metrics
from tests.fakes.fake_latency import (
    Distribution,
    FakeLatencyEngine,
    FakeLatencySandbox,
    LatencyProfile,
)
from tests.unit.test_fakes_match_services import real_engine_app, real_sandbox_app, routes


def _aiohttp_routes(app) -> set[tuple[str, str]]:
    out = set()
    for route in app.router.routes():
        if route.method == "HEAD":
            continue
        path = re.sub(r"\{sid\}", "{session_id}", route.resource.canonical)
        out.add((route.method, path.replace("{path}", "{path:path}")))
    return out


def _profile(tmp_path) -> LatencyProfile:
    import json

    path = tmp_path / "profile.json"
    path.write_text(json.dumps(build_profile(lambda text: [5] * len(text.split()), 2)))
    return LatencyProfile.load(path)


def test_every_route_of_the_latency_engine_is_a_route_of_the_real_engine(tmp_path):
    real = set(routes(real_engine_app()))
    fake = _aiohttp_routes(FakeLatencyEngine(_profile(tmp_path), 0).app())
    assert fake - real == set()


def test_every_route_of_the_latency_sandbox_is_a_route_of_the_real_sandbox(tmp_path):
    real = set(routes(real_sandbox_app(tmp_path)))
    fake = _aiohttp_routes(FakeLatencySandbox(_profile(tmp_path), 0).app())
    assert fake - real == set()


def test_draws_stay_inside_the_recorded_buckets_and_keep_their_mean():
    dist = Distribution.from_json(histogram(read_metrics(), "shellrl_rollout_generate_seconds"))
    rng = random.Random(0)
    draws = [dist.draw(rng) for _ in range(20_000)]
    assert 0 < min(draws) and max(draws) <= dist.bounds[-1]
    assert abs(sum(draws) / len(draws) - dist.mean()) < 0.05 * dist.mean()
