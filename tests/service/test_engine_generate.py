"""The engine over real HTTP with the tiny model: log-prob parity, batching, prefix cache, pause/abort,
bad input. One engine process for the module."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_responses import EngineError
from tests.helpers.engine import engine_loads, reference_logprobs, running_engine
from tests.helpers.waiting import wait_until_async

PARITY_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with running_engine(tmp_path_factory.mktemp("engine")) as process:
        yield process


@pytest.fixture
async def client(engine):
    async with EngineClient([engine.url], timeout_s=120) as c:
        yield c


async def _until_running(engine, n: int, what: str) -> None:
    """Until the engine runs `n` requests (each sampled its first token at prefill): on a loaded
    machine a request may reach the engine seconds after it was sent."""
    await wait_until_async(
        lambda: asyncio.to_thread(lambda: engine_loads(engine.url)["num_running_reqs"] == n),
        30,
        what,
    )


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


async def test_logprobs_match_a_plain_forward_in_another_process_despite_batching_and_prefix_cache(
    client, tmp_path
):
    rng = random.Random(1)
    shared = _tokens(rng, 40)
    sampling = [
        {"temperature": 0.7},
        {"temperature": 1.0, "sampling_seed": 3},
        {"temperature": 0.0},
        {"temperature": 1.0, "top_p": 0.9},
        {"temperature": 0.8, "top_k": 50},
        {"temperature": 1.3, "min_p": 0.01},
    ]
    prompts = [shared + _tokens(rng, rng.randrange(1, 30)) for _ in sampling]
    # different lengths: rows finish at different steps and stay as padding until compaction, while
    # a late request joins the running batch
    late_prompt = _tokens(rng, 17)
    wave = [
        asyncio.create_task(
            client.generate(p, {**s, "max_new_tokens": 6 + 4 * i, "ignore_eos": True})
        )
        for i, (p, s) in enumerate(zip(prompts, sampling))
    ]
    await asyncio.sleep(0.3)
    late = await client.generate(
        late_prompt, {"temperature": 0.9, "max_new_tokens": 20, "ignore_eos": True}
    )
    first = await asyncio.gather(*wave)
    # second turn: previous prompt + its output + new tokens, so the prefix cache serves generated tokens too
    turns = [p + r.output_ids + _tokens(rng, 5) for p, r in zip(prompts, first)]
    second = await asyncio.gather(
        *(
            client.generate(p, {**s, "max_new_tokens": 16, "ignore_eos": True})
            for p, s in zip(turns, sampling)
        )
    )
    assert max(r.cached_tokens for r in first[1:]) >= len(shared) - 1
    assert all(r.cached_tokens >= len(p) for r, p in zip(second, prompts))

    cases, results = [], []
    for batch_prompts, batch in ((prompts, first), (turns, second)):
        for prompt, result, s in zip(batch_prompts, batch, sampling):
            assert len(result.output_ids) == len(result.output_logprobs) > 0
            cases.append(
                {"prompt": prompt, "output": result.output_ids, "temperature": s["temperature"]}
            )
            results.append(result)
    cases.append({"prompt": late_prompt, "output": late.output_ids, "temperature": 0.9})
    results.append(late)
    expected = reference_logprobs(cases, tmp_path)
    worst = max(abs(a - b) for r, e in zip(results, expected) for a, b in zip(r.output_logprobs, e))
    assert worst <= PARITY_TOLERANCE, f"max |engine - reference| = {worst}"


async def test_batched_and_sequential_greedy_generation_give_identical_tokens(client):
    rng = random.Random(2)
    prompts = [_tokens(rng, n) for n in (5, 17, 9, 30)]
    params = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}
    batched = await asyncio.gather(*(client.generate(p, params) for p in prompts))
    await client.flush_cache()
    sequential = [await client.generate(p, params) for p in prompts]
    assert [r.output_ids for r in batched] == [r.output_ids for r in sequential]
    for b, s in zip(batched, sequential):
        assert (
            max(abs(x - y) for x, y in zip(b.output_logprobs, s.output_logprobs))
            <= PARITY_TOLERANCE
        )


async def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(client):
    rng = random.Random(3)
    prompt = _tokens(rng, 12)
    params = {"temperature": 1.0, "sampling_seed": 42, "max_new_tokens": 12, "ignore_eos": True}
    alone = await client.generate(prompt, params)
    together = await asyncio.gather(
        client.generate(prompt, params), client.generate(_tokens(rng, 7), params)
    )
    assert together[0].output_ids == alone.output_ids


async def test_batch_request_returns_one_object_per_prompt_in_order(engine):
    body = {
        "input_ids": [[101, 102, 103], [104, 105]],
        "rid": "batch",
        "sampling_params": [
            {"max_new_tokens": 3, "temperature": 0},
            {"max_new_tokens": 5, "temperature": 0},
        ],
        "return_logprob": True,
    }
    response = httpx.post(f"{engine.url}/generate", json=body, timeout=60)
    assert response.status_code == 200
    items = response.json()
    assert [i["meta_info"]["id"] for i in items] == ["batch_0", "batch_1"]
    assert [len(i["output_ids"]) for i in items] == [3, 5]
    assert all(
        i["meta_info"]["finish_reason"] == {"type": "length", "length": len(i["output_ids"])}
        for i in items
    )
    assert all(len(i["meta_info"]["output_token_logprobs"]) == len(i["output_ids"]) for i in items)


async def test_max_new_tokens_zero_only_prefills_and_returns_no_tokens(client):
    result = await client.generate([101, 102, 103, 104], {"max_new_tokens": 0})
    assert (
        result.output_ids == [] and result.finish_reason == "length" and result.prompt_tokens == 4
    )


async def test_a_stop_on_the_last_allowed_token_finishes_as_stop_not_length(client):
    # SGLang 0.5.23 checks stop strings, then stop tokens, then the length (Req.update_finish_state);
    # the learner's overlong filter (C06) reads "length" as a cut, so the order matters.
    prompt, k = [101, 102, 103, 104, 105], 6
    greedy = await client.generate(
        prompt, {"temperature": 0.0, "max_new_tokens": k, "ignore_eos": True}
    )
    assert greedy.finish_reason == "length" and len(greedy.output_ids) == k
    # a stop token as the last allowed token: max_new_tokens 1, stop_token_ids = the greedy first token
    first = greedy.output_ids[0]
    by_token = await client.generate(
        prompt, {"temperature": 0.0, "max_new_tokens": 1, "stop_token_ids": [first]}
    )
    assert (by_token.finish_reason, by_token.matched_stop, by_token.output_ids) == (
        "stop",
        first,
        [first],
    )
    # a stop string that only the complete output contains (the whole text), matched on the last allowed token
    text = (
        await client.generate(
            prompt,
            {"temperature": 0.0, "max_new_tokens": k, "ignore_eos": True, "no_stop_trim": True},
        )
    ).text
    by_string = await client.generate(
        prompt,
        {
            "temperature": 0.0,
            "max_new_tokens": k,
            "ignore_eos": True,
            "stop": [text],
            "no_stop_trim": True,
        },
    )
    assert (by_string.finish_reason, by_string.matched_stop) == ("stop", text)
    assert by_string.output_ids == greedy.output_ids


async def test_abort_by_rid_returns_the_partial_tokens_with_their_logprobs(client, engine):
    task = asyncio.create_task(
        client.generate(
            [101, 102, 103], {"max_new_tokens": 5000, "ignore_eos": True}, rid="long-one"
        )
    )
    await _until_running(engine, 1, "rid long-one running")
    await client.abort_request("long-one")
    result = await asyncio.wait_for(task, 30)
    assert result.finish_reason == "abort" and result.rid == "long-one"
    assert 0 < len(result.output_ids) < 5000 and len(result.output_logprobs) == len(
        result.output_ids
    )
    # the continuation prompt (prompt + partial ids) is served from the prefix cache
    resumed = await client.generate([101, 102, 103] + result.output_ids, {"max_new_tokens": 2})
    assert resumed.cached_tokens >= 2 + len(result.output_ids)


async def test_pause_holds_new_requests_until_continue(client):
    await client.pause_generation("abort")
    try:
        task = asyncio.create_task(client.generate([101, 102], {"max_new_tokens": 2}))
        await asyncio.sleep(0.5)
        assert not task.done()
        assert (await client.health_generate()) == {client.urls[0]: True}
    finally:
        await client.continue_generation()
    result = await asyncio.wait_for(task, 30)
    assert result.finish_reason == "length" and len(result.output_ids) == 2


async def test_pause_in_abort_mode_returns_in_flight_requests_as_aborted(client, engine):
    tasks = [
        asyncio.create_task(
            client.generate([101 + i, 7, 8], {"max_new_tokens": 5000, "ignore_eos": True})
        )
        for i in range(3)
    ]
    await _until_running(engine, 3, "3 requests running")  # one not there yet would be held
    await client.pause_generation("abort")
    try:
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        await client.continue_generation()
    assert all(
        r.finish_reason == "abort" and len(r.output_ids) == len(r.output_logprobs) for r in results
    )


@pytest.mark.parametrize(
    "body,field",
    [
        ({"input_ids": [], "sampling_params": {}}, "input_ids"),
        ({"input_ids": [1, 2, 10_000_000]}, "input_ids"),
        ({"input_ids": [1, -2]}, "input_ids"),
        (
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}},
            "sampling_params.max_new_tokens",
        ),
        (
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2.5}},
            "sampling_params.max_new_tokens",
        ),
        (
            {"input_ids": [1, 2], "sampling_params": {"temprature": 0.5}},
            "sampling_params.temprature",
        ),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"input_ids": [1, 2], "sampling_params": {"n": 4}}, "sampling_params.n"),
        ({"input_ids": [1, 2], "return_logprobs": True}, "return_logprobs"),
        ({"input_ids": [1, 2], "stream": True}, "stream"),
        ({"sampling_params": {}}, "input_ids"),
        ({"text": ""}, "text"),
        ({"text": ["a", ""]}, "text[1]"),
        # SGLang's total-token check: prompt + max_new_tokens beyond the context (8192 for the tiny model)
        (
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 8191}},
            "sampling_params.max_new_tokens",
        ),
    ],
)
def test_bad_generate_input_gives_400_naming_the_field(engine, body, field):
    response = httpx.post(f"{engine.url}/generate", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["field"] == field and error["message"]


async def test_client_raises_engine_error_with_status_and_body(client):
    with pytest.raises(EngineError) as info:
        await client.generate([], {"max_new_tokens": 1})
    assert info.value.status == 400 and info.value.body["error"]["field"] == "input_ids"


async def test_duplicate_rid_in_flight_is_rejected(client, engine):
    task = asyncio.create_task(
        client.generate([101, 102], {"max_new_tokens": 5000, "ignore_eos": True}, rid="dup")
    )
    await _until_running(engine, 1, "rid dup running")
    with pytest.raises(EngineError, match="Duplicate request ID"):
        await client.generate([101, 102], {"max_new_tokens": 1}, rid="dup")
    await client.abort_request("dup")
    assert (await asyncio.wait_for(task, 30)).finish_reason == "abort"


async def test_a_batch_refused_for_a_duplicate_rid_queues_nothing_and_disturbs_no_other_request(
    client, engine
):
    def running() -> int:
        return engine_loads(engine.url)["num_running_reqs"]

    task = asyncio.create_task(
        client.generate([101, 102], {"max_new_tokens": 8000, "ignore_eos": True}, rid="ab")
    )
    await wait_until_async(lambda: asyncio.to_thread(lambda: running() == 1), 30, "rid ab running")
    batch = {
        "input_ids": [[1, 2], [3, 4]],
        "rid": ["a", "ab"],
        "sampling_params": {"max_new_tokens": 5},
    }
    refused = httpx.post(f"{engine.url}/generate", timeout=30, json=batch)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "duplicate_rid"
    await asyncio.sleep(0.3)
    assert (
        running() == 1 and not task.done()
    )  # "a" was never queued, and "ab" was not aborted by prefix
    await client.abort_request("ab")
    assert (await asyncio.wait_for(task, 30)).finish_reason == "abort"


async def test_info_health_and_metrics_endpoints(engine, client):
    info = (await client.get_model_info())[engine.url]
    assert info["weight_version"] == "default" and info["is_generation"] is True
    server = (await client.get_server_info())[engine.url]
    assert server["tp_size"] == 1 and "internal_states" in server
    assert (await client.health()) == {engine.url: True}
    text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    for name in (
        "shellrl_engine_request_seconds",
        "shellrl_engine_generation_tokens_total",
        "shellrl_engine_batch_size",
    ):
        assert name in text
    flushed = httpx.get(f"{engine.url}/flush_cache", timeout=10)
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed")
    assert httpx.post(f"{engine.url}/abort_request", json={"rid": "nothing"}, timeout=10).text == ""


def test_null_max_new_tokens_means_up_to_the_context_and_sglang_defaults_are_accepted(engine):
    # SGLang reads max_new_tokens null as "no limit" (capped by the context: 8192 for the tiny model),
    # logit_bias {} is its default, and an explicit null top-level field is that field's default.
    prompt = [101 + i % 1000 for i in range(8185)]
    body = {
        "input_ids": prompt,
        "logprob_start_len": None,
        "stream": None,
        "return_logprob": True,
        "sampling_params": {
            "max_new_tokens": None,
            "logit_bias": {},
            "temperature": 0,
            "ignore_eos": True,
        },
    }
    response = httpx.post(f"{engine.url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    item = response.json()
    assert len(item["output_ids"]) == 7 and item["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 7,
    }


async def test_abort_needs_a_live_rid_so_a_batch_parent_aborts_nothing(client, engine):
    # SGLang 0.5.23 drops an abort whose exact rid is not in flight (tokenizer_manager.abort_request)
    def running() -> int:
        return engine_loads(engine.url)["num_running_reqs"]

    children = asyncio.create_task(
        asyncio.to_thread(
            httpx.post,
            f"{engine.url}/generate",
            timeout=120,
            json={
                "input_ids": [[101, 102], [103, 104]],
                "rid": "parent",
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True, "temperature": 0},
            },
        )
    )
    await wait_until_async(
        lambda: asyncio.to_thread(lambda: running() == 2), 30, "both children running"
    )
    await client.abort_request("parent")
    await asyncio.sleep(0.3)  # an abort is a command between two decode steps (~ms here)
    assert running() == 2
    await client.abort_request("parent_0")
    await wait_until_async(
        lambda: asyncio.to_thread(lambda: running() == 1), 10, "parent_0 aborted"
    )
    await client.abort_request("parent_1")
    first, second = (await children).json()
    for item in (first, second):
        assert (
            item["meta_info"]["finish_reason"]["type"] == "abort"
            and 0 < len(item["output_ids"]) < 8000
        )
    assert len(second["output_ids"]) > len(
        first["output_ids"]
    )  # parent_1 ran on after parent_0 ended


def test_nan_and_infinity_are_not_json_numbers(engine):
    # Python's json reads them; a temperature of Infinity would sample from the uniform distribution
    raw = '{"input_ids": [1, 2], "sampling_params": {"temperature": Infinity}}'
    response = httpx.post(
        f"{engine.url}/generate",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert (
        response.status_code == 400
        and "Infinity is not a JSON number" in response.json()["error"]["message"]
    )
    overflow = httpx.post(
        f"{engine.url}/generate",
        timeout=30,
        headers={"content-type": "application/json"},
        content='{"input_ids": [1, 2], "sampling_params": {"temperature": 1e999}}',
    )
    assert (
        overflow.status_code == 400
        and "1e999 overflows a float" in overflow.json()["error"]["message"]
    )
