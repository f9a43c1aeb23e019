"""The engine's request lifecycle beyond a normal answer: a client that goes away, and SIGTERM with
generations in flight. Real engine processes on the tiny model."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx

from tests.helpers.engine import engine_loads, metric_value, running_engine
from tests.helpers.waiting import wait_until, wait_until_async

LONG = {"max_new_tokens": 6000, "ignore_eos": True, "temperature": 0.0}


def test_a_request_whose_client_disconnected_is_aborted(tmp_path):
    # SGLang aborts a request when its client disconnects; otherwise a rollout that timed out leaves
    # the engine decoding thousands of tokens for nobody.
    with running_engine(tmp_path) as engine:
        try:
            httpx.post(
                f"{engine.url}/generate",
                json={"input_ids": [101, 102], "sampling_params": LONG},
                timeout=1.5,
            )
            raise AssertionError("the generation should outlast the client's timeout")
        except httpx.ReadTimeout:
            pass
        wait_until(
            lambda: engine_loads(engine.url)["num_running_reqs"] == 0,
            timeout_s=10,
            what="the disconnected request to be aborted",
        )
        metrics = httpx.get(f"{engine.url}/metrics", timeout=10).text
        assert metric_value(metrics, "shellrl_engine_client_disconnects_total") == 1
        assert metric_value(metrics, "shellrl_engine_requests_total", finish_reason="abort") == 1
        # the engine serves on
        ok = httpx.post(
            f"{engine.url}/generate",
            json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}},
            timeout=30,
        )
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3


async def test_sigterm_ends_in_flight_generations_as_aborts_with_their_tokens(tmp_path):
    # uvicorn cancels handlers still running when its grace ends (a plain-text 500, the tokens lost);
    # the engine ends them as aborts when SHELLRL_SHUTDOWN_GRACE_S is over, 5 s before uvicorn's grace,
    # so the caller can resume them elsewhere (C14).
    grace_s = 3.0
    with running_engine(tmp_path, SHELLRL_SHUTDOWN_GRACE_S=str(grace_s)) as engine:
        async with httpx.AsyncClient(timeout=60) as http:
            body = {
                "input_ids": [[101, 102], [103, 104, 105]],
                "return_logprob": True,
                "sampling_params": [LONG, {**LONG, "max_new_tokens": 6001}],
            }
            task = asyncio.create_task(http.post(f"{engine.url}/generate", json=body))
            await wait_until_async(
                lambda: asyncio.to_thread(
                    lambda: engine_loads(engine.url)["num_running_reqs"] == 2
                ),
                30,
                "both requests running",
            )
            started = time.monotonic()
            engine.signal(signal.SIGTERM)
            response = await task
            answered_s = time.monotonic() - started
        assert response.status_code == 200, response.text
        for item in response.json():
            assert item["meta_info"]["finish_reason"]["type"] == "abort"
            assert 0 < len(item["output_ids"]) == len(item["meta_info"]["output_token_logprobs"])
        assert grace_s - 0.5 <= answered_s <= grace_s + 4, (
            answered_s
        )  # drained for the grace, then aborted
        assert engine.proc.wait(timeout=15) in (0, -signal.SIGTERM)
        assert "CancelledError" not in engine.tail()
