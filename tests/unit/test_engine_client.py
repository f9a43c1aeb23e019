"""EngineClient pieces that need no engine: response checking, routing, retries on connect errors."""

from __future__ import annotations

import pytest

from shellrl.clients.engine import EngineClient
from shellrl.clients.engine_responses import (
    EngineError, EngineUnavailable, VersionSpan, parse_generate_response)
from tests.helpers.redis_server import free_port


def _response(**meta):
    base = {"id": "r1", "finish_reason": {"type": "stop", "matched": "</bash>"}, "prompt_tokens": 3,
            "completion_tokens": 2, "weight_version": "7", "output_token_logprobs": [[-0.5, 11, None], [-1.5, 12, None]]}
    return {"text": "ab", "output_ids": [11, 12], "meta_info": base | meta}


def test_parse_generate_response_pairs_each_id_with_its_logprob():
    result = parse_generate_response(_response(), engine_url="http://e", return_logprob=True)
    assert result.output_ids == [11, 12] and result.output_logprobs == [-0.5, -1.5]
    assert result.finish_reason == "stop" and result.matched_stop == "</bash>" and result.weight_version == "7"
    assert result.weight_versions == (VersionSpan("7", 0, 2),)


def test_parse_generate_response_rejects_logprobs_that_do_not_match_the_ids():
    with pytest.raises(EngineError, match="do not match"):
        parse_generate_response(_response(output_token_logprobs=[[-0.5, 11, None]]), engine_url="e", return_logprob=True)
    with pytest.raises(EngineError, match="do not match"):
        parse_generate_response(_response(output_token_logprobs=[[-0.5, 11, None], [-1.0, 99, None]]),
                                engine_url="e", return_logprob=True)


def test_parse_generate_response_keeps_weight_version_spans():
    spans = [{"version": "7", "start": 0, "end": 1}, {"version": "8", "start": 1, "end": 2}]
    result = parse_generate_response(_response(weight_versions=spans, weight_version="8"), engine_url="e",
                                     return_logprob=True)
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
    client = EngineClient([f"http://127.0.0.1:{free_port()}"], connect_retries=2, retry_backoff_s=0.01)
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
            return httpx.Response(503, json={"error": {"code": "shutting_down", "message": "draining"}})
        return httpx.Response(200, json=_response())

    client = EngineClient(["http://a", "http://b"], transport=httpx.MockTransport(handler), retry_backoff_s=0)
    client._in_flight["http://b"] = 1  # so the first pick is a
    result = await client.generate([1, 2], {"max_new_tokens": 2})
    assert seen == ["a", "b"] and result.output_ids == [11, 12] and result.engine_url == "http://b"
    with pytest.raises(EngineUnavailable, match="shutting down"):
        await client.generate([1, 2], {"max_new_tokens": 2}, url="http://a")
    assert seen == ["a", "b", "a"]
    await client.close()
