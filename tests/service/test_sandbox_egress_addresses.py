"""Names and literals that reach addresses which are not global are refused by the egress proxy
(services/sandbox/egress/addresses.py), with a real resolver (`/etc/hosts`), a real Redis audit
stream and a real upstream. It runs in its own network namespace with only loopback up
(tests/helpers/netns.py): every address aimed at is on that namespace's `lo`, so a forward that
should not happen reaches the scenario's own listener (and is counted) instead of leaving the
machine; a rule naming 100.64.0.1 literally shows the listener is reachable there."""

from __future__ import annotations

from pathlib import Path

import redis.asyncio as aioredis

from shellrl.streams.keys import STREAM_EGRESS
from tests.helpers.egress_proxy import ProxiedGets
from tests.helpers.netns import run_isolated
from tests.helpers.redis_server import RedisServer

NAMES = {  # name → address in /etc/hosts of the scenario's namespace
    "cgnat.test": "100.64.0.1",  # shared address space, 100.64.0.0/10: the escape
    "ietf.test": "192.0.0.9",  # 192.0.0.0/24 (Python calls .9 global)
    "bench.test": "198.18.0.1",  # benchmarking, 198.18.0.0/15
    "class-e.test": "240.0.0.1",  # reserved, 240.0.0.0/4
    "zero.test": "0.0.0.0",
    "mapped.test": "::ffff:100.64.0.1",  # IPv4-mapped
    "nat64.test": "64:ff9b::6440:1",  # NAT64 of 100.64.0.1
    "public.test": "151.101.0.223",  # global: allowed (it lands on lo here)
}
ON_LO = ["100.64.0.1/32", "192.0.0.9/32", "198.18.0.1/32", "151.101.0.223/32"]
ON_LO += ["64:ff9b::6440:1/128"]
ZERO_SPELLINGS = ["0", "00", "0x0", "0x00000000", "000.0.0.0", "0.0.0.0"]


async def scenario(spec: dict) -> dict:
    """In the isolated namespace: GET each name and spelling through the proxy; the statuses,
    the audit's decisions and the connections the upstream got."""
    redis = RedisServer(Path(spec["tmp"]) / "redis").start()
    rules = lambda port: [  # noqa: E731
        {"name": "literal", "host": "100.64.0.1", "ports": [port]},
        {"name": "names", "host": "*.test", "ports": [port]},
    ]
    try:
        async with ProxiedGets(redis.url, "addr", rules) as proxied:
            hosts = [*NAMES, *ZERO_SPELLINGS, "100.64.0.1"]
            statuses = {host: await proxied.get(host) for host in hosts}
        entries = await redis_entries(redis.url)
    finally:
        redis.stop()
    return {"statuses": statuses, "hits": proxied.hits, "audit": entries}


async def redis_entries(url: str) -> list[dict]:
    client = aioredis.Redis.from_url(url, decode_responses=True)
    try:
        return [f for _, f in await client.xrange(STREAM_EGRESS) if f["phase"] == "decision"]
    finally:
        await client.aclose()


def test_names_and_literals_of_addresses_that_are_not_global_are_refused_and_audited():
    result = run_isolated(
        "tests.service.test_sandbox_egress_addresses:scenario", {}, addresses=ON_LO, hosts=NAMES
    )
    statuses, audit = result["statuses"], {e["host"]: e for e in result["audit"]}
    for name in NAMES:
        if name != "public.test":
            assert statuses[name] == 403, (name, statuses)
            assert (audit[name]["verdict"], audit[name]["reason"]) == ("deny", "internal_address")
    # controls: a global name and a rule naming 100.64.0.1 literally reach the listener on lo
    assert statuses["public.test"] == 200 and statuses["100.64.0.1"] == 200, statuses
    assert sorted(result["hits"]) == ["100.64.0.1", "151.101.0.223"], result["hits"]
    # 0.0.0.0 in decimal, octal and hex is one literal: no rule for this port names it
    for spelling in ZERO_SPELLINGS:
        assert statuses[spelling] == 403, (spelling, statuses)
    zero = [e for e in result["audit"] if e["host"] == "0.0.0.0"]
    assert len(zero) == len(ZERO_SPELLINGS) and {e["reason"] for e in zero} == {"no_rule"}
    assert len(result["audit"]) == len(statuses)  # one verdict per request
