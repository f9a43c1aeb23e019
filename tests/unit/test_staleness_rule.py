"""The staleness rule is written once (shellrl/rl/staleness.py); the gateway's admission script in
Redis takes its bound from there, and here the script, run in a real redis-server, agrees with
`max_admitted_groups` on a grid of (version, max_staleness, groups_per_step)."""

from __future__ import annotations

import itertools

import pytest

from services.rollout.admission import Admission
from services.rollout.policy_version import PolicyVersionWatcher
from shellrl.rl.staleness import (
    is_too_stale,
    max_admitted_groups,
    oldest_trainable_version,
)
from shellrl.streams import POLICY_VERSION_KEY, connect
from shellrl.streams.keys import ADMITTED_KEY, INFLIGHT_KEY

VERSIONS = (0, 1, 2, 7, 40)
STALENESS = (0, 1, 2, 5)
GROUPS = (1, 2, 4, 7)


@pytest.fixture
async def redis(redis_server):
    client = connect(redis_server.url)
    yield client
    await client.aclose()


def admission(redis, *, k: int, b: int, strict: bool) -> Admission:
    return Admission(
        redis,
        PolicyVersionWatcher(redis, poll_s=0.05),
        replica="rollout-0",
        max_staleness=k,
        groups_per_step=b,
        strict=strict,
        poll_s=0.05,
    )


async def test_admission_script_and_max_admitted_groups_agree_on_a_grid(redis):
    for version, k, b in itertools.product(VERSIONS, STALENESS, GROUPS):
        bound = max_admitted_groups(version, k, b)
        adm = admission(redis, k=k, b=b, strict=False)
        await redis.delete(INFLIGHT_KEY)
        await redis.set(POLICY_VERSION_KEY, version)
        await redis.set(ADMITTED_KEY, bound)  # full: the script refuses, and names its bound
        assert await adm.try_admit("full") is None
        assert (await adm.state()).bound == bound
        await redis.set(ADMITTED_KEY, bound - 1)  # one slot left: admitted, at the bound
        ticket = await adm.try_admit(f"g-{version}-{k}-{b}")
        assert ticket is not None, (version, k, b)
        assert (ticket.bound, ticket.admitted, ticket.policy_version) == (bound, bound, version)


async def test_strict_admission_script_bounds_by_the_oldest_group_in_flight_as_python_does(redis):
    for version, k, b in itertools.product(VERSIONS, STALENESS, GROUPS):
        oldest = max(0, version - 3)
        adm = admission(redis, k=k, b=b, strict=True)
        await redis.delete(INFLIGHT_KEY)
        await redis.zadd(INFLIGHT_KEY, {"rollout-9|old": oldest})
        await redis.set(POLICY_VERSION_KEY, version)
        bound = max_admitted_groups(min(version, oldest), k, b)
        await redis.set(ADMITTED_KEY, bound)
        assert await adm.try_admit("full") is None
        assert (await adm.state()).bound == bound
        await redis.set(ADMITTED_KEY, bound - 1)
        ticket = await adm.try_admit(f"g-{version}-{k}-{b}")
        assert ticket is not None and ticket.bound == bound, (version, k, b)


def test_oldest_trainable_version_is_where_is_too_stale_starts():
    for version, k in itertools.product(VERSIONS, STALENESS):
        floor = oldest_trainable_version(version, k)
        assert not is_too_stale(version, floor, k)
        assert is_too_stale(version, floor - 1, k)
