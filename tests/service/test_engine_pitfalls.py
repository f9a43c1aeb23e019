"""Pitfalls C14, C15 and C22 (/work/shared/reference/known_pitfalls.md) against a real engine process.

C14: an abort returns every token generated so far, each with its log-prob, also for a request that
was moved back to the queue; the episode resumes from prompt + partial ids. C15: aborts at random
moments of a chunked prefill leak no token and leave no KV behind. C22: weight pushes at random
moments under load all complete, and new requests are labelled (and computed) with the new version.

Scaled to the tiny model on a 2-core CPU: 16 running requests at most (so 48 of 64 wait in the
queue), prefill chunks of 512 tokens, 2,000-token prompts (the model's context is 8,192), greedy
sampling (a draw over the 49k vocabulary costs ~1 ms a row here). One engine for the module.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import uuid

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from shellrl.clients.engine import EngineClient
from shellrl.models import load_model
from shellrl.weights import shm
from tests.helpers.engine import perturbed, running_engine

MAX_RUNNING = 16
MAX_PREFILL_TOKENS = 512
LONG = {"max_new_tokens": 4096, "ignore_eos": True, "temperature": 0.0}
C14_REQUESTS = 64
C15_ABORTS = 120
C15_PROMPT_TOKENS = 2000  # four prefill chunks
C22_PUSHES = 20
C22_LONG_REQUESTS = 8
PUSH_DEADLINE_S = 10.0  # a push that waits for a whole 4096-token generation takes ~30 s here
PARITY_TOLERANCE = 1e-4
GENERATED = "shellrl_engine_generation_tokens_total"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running_engine(
        tmp_path_factory.mktemp("engine"),
        SHELLRL_MAX_RUNNING_REQUESTS=str(MAX_RUNNING),
        SHELLRL_MAX_PREFILL_TOKENS=str(MAX_PREFILL_TOKENS),
    ) as process:
        yield process


@pytest.fixture
async def http():
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=256)) as client:
        yield client


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


async def _generate(
    http: httpx.AsyncClient, url: str, prompt: list[int], params: dict, rid: str | None = None
) -> dict:
    body = {
        "input_ids": prompt,
        "sampling_params": params,
        "return_logprob": True,
        "rid": rid or uuid.uuid4().hex,
    }
    response = await http.post(f"{url}/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def _checked_ids(out: dict, max_new_tokens: int) -> list[int]:
    """The output ids, after checking what holds for every finish reason: one finite log-prob per id,
    for that id, and no more ids than asked for."""
    ids, meta = out["output_ids"], out["meta_info"]
    logprobs = meta["output_token_logprobs"]
    assert len(ids) == len(logprobs) == meta["completion_tokens"], meta
    assert [entry[1] for entry in logprobs] == ids
    assert all(math.isfinite(entry[0]) and entry[0] <= 0 for entry in logprobs)
    assert len(ids) <= max_new_tokens
    return ids


async def _metrics(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The engine's unlabelled Prometheus samples by name."""
    text = (await http.get(f"{url}/metrics")).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


async def _loads(http: httpx.AsyncClient, url: str) -> dict:
    return (await http.get(f"{url}/v1/loads")).json()["loads"][0]


async def _until(check, timeout_s: float, what: str):
    """Poll the coroutine function `check` until it returns something truthy; returns that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result := await check():
            return result
        await asyncio.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


# ----- C14 ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["pause_abort", "retract_then_abort_all"])
async def test_aborted_requests_return_every_token_generated_so_far_and_resume_from_them(
    engine, http, stop
):
    rng = random.Random(f"c14-{stop}")
    prompts = [_tokens(rng, rng.randrange(8, 24)) for _ in range(C14_REQUESTS)]
    before = await _metrics(http, engine.url)
    tasks = [asyncio.create_task(_generate(http, engine.url, p, LONG)) for p in prompts]

    async def full():
        loads = await _loads(http, engine.url)
        return (
            loads["num_running_reqs"] == MAX_RUNNING
            and loads["num_waiting_reqs"] == C14_REQUESTS - MAX_RUNNING
        )

    await _until(full, 30, f"{MAX_RUNNING} running and the rest queued")

    async def sampled():  # a few decode steps of the whole running batch: each has tokens
        return (await _metrics(http, engine.url))[GENERATED] - before[GENERATED] >= 4 * MAX_RUNNING

    await _until(sampled, 60, "four decode steps of the running requests")
    try:
        running = (await _loads(http, engine.url))[
            "num_running_reqs"
        ]  # each has sampled >= 1 token
        if stop == "pause_abort":
            await http.post(f"{engine.url}/pause_generation", json={"mode": "abort"})
        else:  # pitfall C14's case: requests with tokens moved back to the queue, then aborted there
            await http.post(f"{engine.url}/pause_generation", json={"mode": "retract"})
            loads = await _loads(http, engine.url)
            assert (loads["num_running_reqs"], loads["num_waiting_reqs"]) == (0, C14_REQUESTS)
            await http.post(f"{engine.url}/abort_request", json={"abort_all": True})
        outs = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        await http.post(f"{engine.url}/continue_generation", json={})
    generated = (await _metrics(http, engine.url))[GENERATED] - before[GENERATED]

    assert all(out["meta_info"]["finish_reason"]["type"] == "abort" for out in outs)
    partial = [
        (prompt, _checked_ids(out, LONG["max_new_tokens"])) for prompt, out in zip(prompts, outs)
    ]
    partial = [(prompt, ids) for prompt, ids in partial if ids]
    assert running == MAX_RUNNING and len(partial) == running, (
        "a request that had tokens came back empty"
    )
    assert sum(len(ids) for _, ids in partial) == generated, (
        "sampled tokens missing from the responses"
    )

    continued = [prompt + ids for prompt, ids in partial]
    resumed = await asyncio.gather(
        *(_generate(http, engine.url, c, {**LONG, "max_new_tokens": 8}) for c in continued)
    )
    for prompt, out in zip(continued, resumed):
        assert (
            out["meta_info"]["finish_reason"]["type"] == "length" and len(_checked_ids(out, 8)) == 8
        )
        # the engine's own record of the sequence is prompt + exactly the returned ids: all of it but
        # the newest token (which has no KV yet) is served from the prefix cache
        assert (out["meta_info"]["prompt_tokens"], out["meta_info"]["cached_tokens"]) == (
            len(prompt),
            len(prompt) - 1,
        )


# ----- C15 ---------------------------------------------------------------------------------------------


async def test_aborts_during_a_chunked_prefill_leak_no_token_and_the_kv_returns_to_idle(
    engine, http
):
    rng = random.Random(15)
    before = await _metrics(http, engine.url)
    outs = []
    for _ in range(C15_ABORTS):
        prompt, rid = _tokens(rng, C15_PROMPT_TOKENS), uuid.uuid4().hex
        task = asyncio.create_task(_generate(http, engine.url, prompt, LONG, rid=rid))
        await asyncio.sleep(rng.uniform(0.001, 0.050))
        while True:
            await http.post(f"{engine.url}/abort_request", json={"rid": rid})
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                break  # else the abort reached the engine before the request did (a no-op): again
        out = task.result()
        assert out["meta_info"]["finish_reason"]["type"] == "abort", out["meta_info"]
        outs.append((prompt, _checked_ids(out, LONG["max_new_tokens"])))
    partial = [(prompt, ids) for prompt, ids in outs if ids]
    continued = [prompt + ids for prompt, ids in partial]
    resumed = await asyncio.gather(
        *(_generate(http, engine.url, c, {**LONG, "max_new_tokens": 1}) for c in continued)
    )
    for prompt, out in zip(continued, resumed):
        assert len(_checked_ids(out, 1)) == 1
        assert out["meta_info"]["cached_tokens"] == len(prompt) - 1, (
            "the engine's sequence is not prompt + ids"
        )

    async def idle():
        now = await _metrics(http, engine.url)
        running = now["shellrl_engine_running_requests"] + now["shellrl_engine_waiting_requests"]
        return now if running == 0 and now["shellrl_engine_kv_bytes"] == 0 else None

    after = await _until(idle, 5, "no request left and no KV held besides the prefix cache")
    returned = sum(len(ids) for _, ids in outs) + sum(len(out["output_ids"]) for out in resumed)
    assert after[GENERATED] - before[GENERATED] == returned, "a sampled token was not returned"
    assert (await http.post(f"{engine.url}/flush_cache")).status_code == 200
    await _until(
        lambda: _prefix_cache_empty(http, engine.url), 5, "the flushed prefix cache holds no KV"
    )


async def _prefix_cache_empty(http: httpx.AsyncClient, url: str) -> bool:
    return (await _metrics(http, url))["shellrl_engine_prefix_cache_bytes"] == 0


# ----- C22 ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_weights() -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in load_model("tiny").named_parameters()}


async def _push(client: EngineClient, named, version: str, style: str) -> None:
    """A weight push as the learner sends it (shared-memory bucket, one session), with the in-flight
    requests aborted either by the update itself or by an abort pause around it."""
    with shm.SharedMemoryBucket(named) as bucket:
        if style == "abort_all":
            await client.update_weights_from_tensor(
                [bucket.payload()], weight_version=version, abort_all_requests=True
            )
            return
        await client.pause_generation("abort")
        try:
            await client.update_weights_from_tensor([bucket.payload()], weight_version=version)
        finally:
            await client.continue_generation()


def _version(label: str) -> int:
    return 0 if label == "default" else int(label)


async def test_weight_pushes_at_random_moments_under_load_all_complete_and_label_new_requests(
    engine, http, base_weights
):
    rng = random.Random(22)
    weight_sets = [perturbed(base_weights, 220), perturbed(base_weights, 221)]
    styles = ["abort_all", "pause_abort"] * (C22_PUSHES // 2)
    rng.shuffle(styles)
    # the probe's first token is one no other request starts with: it shares no prefix with them
    probe_prompt, probe_params = [50, *_tokens(rng, 8)], {"max_new_tokens": 4, "temperature": 0.0}
    state = {"started": 0, "done": 0}  # pushes started / completed
    records = []  # (pushes done at submission, pushes started at the answer, max_new_tokens, response)
    unhealthy = []
    stop = asyncio.Event()

    async def request(prompt: list[int], params: dict) -> dict:
        submitted_after = state["done"]
        out = await _generate(http, engine.url, prompt, params)
        records.append((submitted_after, state["started"], params["max_new_tokens"], out))
        return out

    async def long_request() -> None:  # resumed from its partial tokens whenever it is aborted
        prompt, budget = _tokens(rng, 12), LONG["max_new_tokens"]
        while not stop.is_set() and budget > 0:
            out = await request(prompt, {**LONG, "max_new_tokens": budget})
            prompt, budget = prompt + out["output_ids"], budget - len(out["output_ids"])

    async def arrivals() -> None:
        while not stop.is_set():
            await request(
                _tokens(rng, rng.randrange(4, 40)),
                {"max_new_tokens": rng.randrange(1, 33), "ignore_eos": True, "temperature": 0.0},
            )
            await asyncio.sleep(rng.uniform(0.0, 0.05))

    async def health() -> None:
        while not stop.is_set():
            response = await http.get(f"{engine.url}/health")
            if response.status_code != 200:
                unhealthy.append(response.status_code)
            await asyncio.sleep(0.2)

    async with EngineClient([engine.url], timeout_s=60) as client:
        workers = [asyncio.create_task(long_request()) for _ in range(C22_LONG_REQUESTS)]
        workers += [asyncio.create_task(arrivals()) for _ in range(2)] + [
            asyncio.create_task(health())
        ]
        await _until(
            lambda: _running_at_least(http, engine.url, C22_LONG_REQUESTS),
            30,
            "long requests running",
        )
        probes: dict[int, dict] = {}
        try:
            for k in range(1, C22_PUSHES + 1):
                await asyncio.sleep(rng.uniform(0.05, 0.4))
                state["started"] = k
                try:
                    await asyncio.wait_for(
                        _push(client, weight_sets[k % 2], str(k), styles[k - 1]), PUSH_DEADLINE_S
                    )
                except TimeoutError:
                    pytest.fail(
                        f"push {k} ({styles[k - 1]}) did not complete within {PUSH_DEADLINE_S} s"
                    )
                state["done"] = k
                probe = await _generate(
                    http, engine.url, probe_prompt, probe_params
                )  # first request after it
                assert probe["meta_info"]["weight_versions"] == [
                    {"version": str(k), "start": 0, "end": 4}
                ]
                assert probe["meta_info"]["cached_tokens"] == 0, "KV of the old weights was reused"
                assert (await client.get_weight_version()) == {engine.url: str(k)}
                assert (await http.get(f"{engine.url}/health")).status_code == 200
                # computed with the weights of version k: as the first probe after the same weights
                first = probes.setdefault(k % 2, probe)
                assert probe["output_ids"] == first["output_ids"]
                got, want = (p["meta_info"]["output_token_logprobs"] for p in (probe, first))
                assert max(abs(a[0] - b[0]) for a, b in zip(got, want)) <= PARITY_TOLERANCE
        finally:
            stop.set()
            await client.abort_request(abort_all=True)
            await asyncio.wait_for(asyncio.gather(*workers), 30)
    (a, b) = (probes[i]["meta_info"]["output_token_logprobs"] for i in (0, 1))
    assert max(abs(x[0] - y[0]) for x, y in zip(a, b)) > 1e-3, (
        "the two weight sets give the same log-probs"
    )

    assert not unhealthy
    aborted_with_tokens = 0
    for submitted_after, started_at_answer, max_new_tokens, out in records:
        ids, meta = _checked_ids(out, max_new_tokens), out["meta_info"]
        reason = meta["finish_reason"]["type"]
        assert reason in ("length", "abort") and (reason == "abort" or len(ids) == max_new_tokens)
        aborted_with_tokens += reason == "abort" and bool(ids)
        spans = meta["weight_versions"]
        # in flight during a push: finished on the old version or aborted, never continued on the new one
        assert len(spans) <= 1, spans
        if spans:
            assert submitted_after <= _version(spans[0]["version"]) <= started_at_answer, (
                spans,
                submitted_after,
            )
    assert aborted_with_tokens >= C22_LONG_REQUESTS, (
        "the pushes never caught the long requests in flight"
    )


async def _running_at_least(http: httpx.AsyncClient, url: str, n: int) -> bool:
    return (await _loads(http, url))["num_running_reqs"] >= n
