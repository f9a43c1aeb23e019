"""The sandbox's warm pool (services/sandbox/sessions/warm_pool.py) on a real service: a repeating setup
gets ready sessions whose setup ran, each handed out once, refilled; warm sessions give way to
requests at the session cap."""

from __future__ import annotations

import httpx

from shellrl.clients.sandbox import SandboxClient
from tests.helpers.waiting import wait_until_async

SETUP = "echo $RANDOM$$ > made.txt; seq 3 > numbers.txt"


async def warm_pool(url: str) -> dict:
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{url}/readyz")).json()["warm_pool"]


async def ready_at_least(url: str, n: int) -> None:
    async def enough() -> bool:
        return (await warm_pool(url))["ready"] >= n

    await wait_until_async(enough, 20.0, f"{n} warm sessions")


async def test_a_repeated_setup_gets_ready_sessions_each_handed_out_once_and_refilled(
    sandbox_services,
):
    service = sandbox_services.get(
        "bubblewrap", warm_pool_per_setup="2", warm_pool_min_repeats="2", max_sessions="12"
    )
    async with SandboxClient(service.url) as client:
        cold = [await client.create_session(setup=SETUP, env={"T": "a"}) for _ in range(2)]
        assert [s["warm"] for s in cold] == [False, False]
        await ready_at_least(service.url, 2)
        handed = []
        for _ in range(4):  # two from the pool, then the refills
            await ready_at_least(service.url, 1)
            session = await client.create_session(setup=SETUP, env={"T": "a"})
            assert session["warm"] is True and session["setup"]["exit_code"] == 0
            result = await client.exec(session["session_id"], "cat numbers.txt; echo $T")
            assert result.stdout == "1\n2\n3\na\n"  # its setup ran, with this env
            handed.append(session)
        ids = [s["session_id"] for s in cold + handed]
        assert len(set(ids)) == len(ids)  # never one session twice
        made = [(await client.read_file(s["session_id"], "made.txt")) for s in handed]
        assert len(set(made)) == len(made)  # each ran its own setup
        other = await client.create_session(setup=SETUP, env={"T": "b"})  # another env: cold
        assert other["warm"] is False
        for session in cold + handed + [other]:
            await client.delete(session["session_id"])
        await ready_at_least(service.url, 2)  # refilled after the last hand-out
        pool = await warm_pool(service.url)
        assert pool["hits"] == 4 and pool["ready"] == 2


async def test_warm_sessions_give_way_to_requests_at_the_session_cap(sandbox_services):
    service = sandbox_services.get(
        "bubblewrap",
        warm_pool_per_setup="2",
        warm_pool_min_repeats="1",
        warm_pool_reserve_sessions="0",
        max_sessions="3",
    )
    async with SandboxClient(service.url) as client:
        first = await client.create_session(setup="echo x > x.txt")
        await ready_at_least(service.url, 2)  # 1 live + 2 warm: the cap
        sessions = [await client.create_session(setup=f"echo {i} > y.txt") for i in range(2)]
        assert [s["warm"] for s in sessions] == [False, False]  # no 429: warm ones evicted
        assert (await warm_pool(service.url))["evicted"] >= 2
        for session in [first, *sessions]:
            await client.delete(session["session_id"])


async def test_at_its_bound_the_pool_keeps_the_most_recently_asked_setup(sandbox_services):
    service = sandbox_services.get(
        "bubblewrap",
        warm_pool_per_setup="1",
        warm_pool_max_sessions="1",
        warm_pool_min_repeats="1",
    )
    async with SandboxClient(service.url) as client:
        first = await client.create_session(setup="echo a > a.txt")
        await ready_at_least(service.url, 1)  # a warm "a"
        second = await client.create_session(setup="echo b > b.txt")
        assert second["warm"] is False

        async def displaced() -> bool:
            pool = await warm_pool(service.url)
            return pool["evicted"] >= 1 and pool["ready"] == 1

        await wait_until_async(displaced, 20.0, "the warm 'a' replaced by a warm 'b'")
        warm_b = await client.create_session(setup="echo b > b.txt")
        cold_a = await client.create_session(setup="echo a > a.txt")
        assert (warm_b["warm"], cold_a["warm"]) == (True, False)
        for session in (first, second, warm_b, cold_a):
            await client.delete(session["session_id"])
