"""EngineClient pieces that need no engine: response checking, routing, retries on connect errors."""

from __future__ import annotations

import math

import pytest

from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_responses import (
    EngineError,
    EngineUnavailable,
    VersionSpan,
    parse_generate_response,
)
from tests.helpers.redis_server import free_port


def _response(**meta):
    base = {
        "id": "r1",
        "finish_reason": {"type": "stop", "matched": "</bash>"},
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "weight_version": "7",
        "output_token_logprobs": [[-0.5, 11, None], [-1.5, 12, None]],
    }
    return {"text": "ab", "output_ids": [11, 12], "meta_info": base | meta}


def test_parse_generate_response_pairs_each_id_with_its_logprob():
    result = parse_generate_response(_response(), engine_url="http://e", return_logprob=True)
    assert result.output_ids == [11, 12] and result.output_logprobs == [-0.5, -1.5]
    assert (
        result.finish_reason == "stop"
        and result.matched_stop == "</bash>"
        and result.weight_version == "7"
    )
    assert result.weight_versions == (VersionSpan("7", 0, 2),)


def test_parse_generate_response_rejects_logprobs_that_do_not_match_the_ids():
    with pytest.raises(EngineError, match="do not match"):
        parse_generate_response(
            _response(output_token_logprobs=[[-0.5, 11, None]]), engine_url="e", return_logprob=True
        )
    with pytest.raises(EngineError, match="do not match"):
        parse_generate_response(
            _response(output_token_logprobs=[[-0.5, 11, None], [-1.0, 99, None]]),
            engine_url="e",
            return_logprob=True,
        )


def test_parse_generate_response_keeps_weight_version_spans():
    spans = [{"version": "7", "start": 0, "end": 1}, {"version": "8", "start": 1, "end": 2}]
    result = parse_generate_response(
        _response(weight_versions=spans, weight_version="8"), engine_url="e", return_logprob=True
    )
    assert result.weight_versions == (VersionSpan("7", 0, 1), VersionSpan("8", 1, 2))


def test_routing_prefers_the_least_loaded_available_engine():
    client = EngineClient(["http://a", "http://b", "http://c"])
    client._in_flight.update({"http://a": 2, "http://b": 0, "http://c": 1})
    assert client._pick(set()) == "http://b"
    client.set_available("http://b", False)
    assert client._pick(set()) == "http://c"
    for url in client.urls:
        client.set_available(url, False)
    with pytest.raises(EngineUnavailable):
        client._pick(set())


async def test_generate_to_a_closed_port_retries_then_raises_engine_unavailable():
    client = EngineClient(
        [f"http://127.0.0.1:{free_port()}"], connect_retries=2, retry_backoff_s=0.01
    )
    with pytest.raises(EngineUnavailable, match="cannot connect"):
        await client.generate([1, 2], {"max_new_tokens": 1})
    assert client.in_flight() == {client.urls[0]: 0}
    await client.close()


async def test_a_generate_refused_by_a_draining_engine_goes_to_another_engine():
    # FAKE transport injecting the fault: engine a is draining for SIGTERM (503 shutting_down, the
    # request never ran), engine b answers. Neither 503 of another kind nor a pinned url is re-sent.
    import httpx

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        if request.url.host == "a":
            return httpx.Response(
                503, json={"error": {"code": "shutting_down", "message": "draining"}}
            )
        return httpx.Response(200, json=_response())

    client = EngineClient(
        ["http://a", "http://b"], transport=httpx.MockTransport(handler), retry_backoff_s=0
    )
    client._in_flight["http://b"] = 1  # so the first pick is a
    result = await client.generate([1, 2], {"max_new_tokens": 2})
    assert seen == ["a", "b"] and result.output_ids == [11, 12] and result.engine_url == "http://b"
    with pytest.raises(EngineUnavailable, match="shutting down"):
        await client.generate([1, 2], {"max_new_tokens": 2}, url="http://a")
    assert seen == ["a", "b", "a"]
    await client.close()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1e-6, 0.5, None, "-0.5", True])
def test_parse_generate_response_rejects_a_logprob_that_is_not_finite_and_at_most_zero(bad):
    """Issue 15 item 4: NaN, +-inf, > 0 (a probability above 1), JSON null, or no number at all."""
    body = _response(output_token_logprobs=[[-0.5, 11, None], [bad, 12, None]])
    with pytest.raises(EngineError, match=r"output_token_logprobs\[1\] is .*finite and <= 0"):
        parse_generate_response(body, engine_url="e", return_logprob=True)
    # without log-probs asked for, the entries are not read
    assert parse_generate_response(body, engine_url="e", return_logprob=False).output_logprobs == []


def test_parse_generate_response_keeps_a_logprob_of_exactly_zero_and_very_negative_ones():
    body = _response(output_token_logprobs=[[0.0, 11, None], [-1e30, 12, None]])
    result = parse_generate_response(body, engine_url="e", return_logprob=True)
    assert result.output_logprobs == [0.0, -1e30]
    body = _response(output_token_logprobs=[[-0.0, 11, None], [-3, 12, None]])  # an int is a number
    result = parse_generate_response(body, engine_url="e", return_logprob=True)
    assert result.output_logprobs == [0.0, -3.0]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.25, None])
async def test_generate_from_an_http_engine_answering_a_bad_logprob_raises_engine_error(bad):
    """A FAKE engine on a real HTTP server sends the body as a broken engine would (`NaN`,
    `Infinity`, `-Infinity` JSON literals, a positive number, null): EngineError, not a result."""
    from tests.fakes.fake_engine import Reply, ScriptedEngine, serve_in_thread

    fake = ScriptedEngine(lambda body: Reply([11, 12, 13], [-0.1, bad, -0.2], matched=13))
    server = serve_in_thread(fake.app())
    try:
        async with EngineClient(server.url) as client:
            with pytest.raises(EngineError, match=r"HTTP 200: output_token_logprobs\[1\] is"):
                await client.generate([1, 2], {"max_new_tokens": 3})
            fake.script = lambda body: Reply([11], [-0.1], matched=11)  # the engine recovers
            assert (await client.generate([1, 2], {"max_new_tokens": 1})).output_logprobs == [-0.1]
    finally:
        server.stop()
    assert len(fake.requests) == 2  # not re-sent: a body out of contract is no connect error


@pytest.mark.parametrize(
    "params",
    [
        {"max_new_tokens": 3, "temperature": 0.7, "stop": ["</bash>"], "no_stop_trim": True},
        {"max_new_tokens": 3, "temperature": math.nan},  # json's NaN literal: the engine's 400
        {"max_new_tokens": 3, "sampling_seed": 2**70},  # past 64 bits: json writes it exactly
    ],
)
async def test_generate_sends_the_body_json_would_send(params):
    """The body goes out through orjson (fast) unless only json can write it as it is."""
    from tests.fakes.fake_engine import Reply, ScriptedEngine, serve_in_thread

    fake = ScriptedEngine(lambda body: Reply([11], [-0.1], matched=11))
    server = serve_in_thread(fake.app())
    try:
        async with EngineClient(server.url) as client:
            await client.generate([1, 2, 3], params, rid="r")
    finally:
        server.stop()
    sent = fake.requests[0]
    assert sent["input_ids"] == [1, 2, 3] and sent["rid"] == "r" and sent["return_logprob"]
    assert repr(sent["sampling_params"]) == repr(params)  # nan == nan by repr
