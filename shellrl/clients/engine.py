"""Async client for SGLang's HTTP API (a real SGLang server or shellrl's CPU engine `services/engine`).

Used by the rollout service (`generate`) and the learner (weight sync, pause/continue). Field names
and formats follow SGLang 0.5.23; see docs/sglang.md for each field and its source path.

Routing (`engine_routing.EngineRouting`): `generate` goes to the routable engine with the fewest
requests in flight from this client (ties broken round-robin), or to `url=` when given (the agent
loop pins each episode to the engine that holds its prefix in cache); a pinned engine that takes
no traffic now raises `EngineNotRoutable` without sending anything. An answer sampled with weights
below the staleness floor raises `StaleEngine` (its tokens are discarded). Control calls (weight
updates, pause, abort, flush, info) fan out to every member engine (or `urls=`) concurrently,
because in SGLang deployments they go to each engine directly, never through a router, and return
`{url: result}`.

Retries: only on errors where the request provably never ran (connect errors, connect timeouts,
and shellrl's engine answering 503 `shutting_down` while it drains), at most `connect_retries`
extra attempts with a growing pause; a `generate` retry may go to another engine. A request that
may have run (read timeout, dropped connection, any other HTTP status) is never re-sent: the caller
gets `EngineUnavailable` or `EngineError`.

Errors: `EngineUnavailable` (cannot connect, or no answer within the timeout; its kinds
`EngineNotRoutable` and `StaleEngine` above), `EngineError` (HTTP 4xx/5xx, or a response that
breaks the contract; carries `status`, `body`, `url`).
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterable

import orjson

from shellrl.clients.engine_fleet import EngineFleet
from shellrl.clients.engine_responses import (
    EngineError,
    EngineUnavailable,
    GenerateResult,
    body_of,
    error_code,
    parse_generate_response,
)
from shellrl.clients.engine_retry import Resend, resends, send_once
from shellrl.clients.engine_routing import EngineNotRoutable, StaleEngine

__all__ = ["EngineClient", "EngineNotRoutable", "StaleEngine"]


class EngineClient(EngineFleet):
    """SGLang HTTP client over one or more engine URLs (see the module docstring): `generate`
    routed to one engine, control calls fanned out to all (`EngineFleet`)."""

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        url: str | None = None,
        avoid: Iterable[str] = (),
    ) -> GenerateResult:
        """POST /generate for one token-in/token-out request.

        input_ids: prompt token ids (non-empty). sampling_params: SGLang names (temperature, top_p,
        top_k, max_new_tokens, stop, stop_token_ids, no_stop_trim, skip_special_tokens, ...).
        rid: request id for `abort_request` (a uuid4 hex when None). url: pin to one engine
        (EngineNotRoutable when it takes no traffic now). avoid: engines not to pick while another
        one is routable (e.g. the one an episode's last request failed on).
        Raises EngineUnavailable (EngineNotRoutable, StaleEngine), EngineError (400: bad input).
        """
        rid = rid or uuid.uuid4().hex
        body = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params),
            "return_logprob": return_logprob,
            "rid": rid,
        }
        content = _json_bytes(body)  # once: a re-send sends the same bytes
        routing = self.routing
        tried: set[str] = {u.rstrip("/") for u in avoid}
        async for attempt in resends(self.connect_retries, self.retry_backoff_s):
            with attempt:  # a re-send may go to another engine
                target = routing.require(url) if url else await routing.pick_when_routable(tried)
                tried.add(target)
                routing.in_flight[target] += 1
                try:
                    response = await send_once(
                        self._http, "POST", target, "/generate", content=content, headers=_JSON
                    )
                except (Resend, EngineUnavailable):
                    routing.mark_suspect(target)
                    raise
                finally:
                    routing.in_flight[target] -= 1
                if response.status_code == 503 and error_code(body_of(response)) == "shutting_down":
                    # shellrl's engine refused it while draining for SIGTERM: it never ran, so it goes
                    # to another engine (or, pinned, is reported like an engine that cannot be reached)
                    routing.mark_suspect(target)
                    refused = EngineUnavailable(target, "engine is shutting down")
                    if url or len(tried) >= len(routing.urls):
                        raise refused
                    raise Resend(refused, backoff=False)
                if response.status_code >= 400:
                    raise EngineError(target, response.status_code, body_of(response))
                result = parse_generate_response(
                    response.json(),
                    engine_url=target,
                    return_logprob=return_logprob,
                    prompt_tokens=len(input_ids),
                )
                routing.check_version(result)
                routing.clear_suspect(target)
                return result
        raise AssertionError("unreachable")


_JSON = {"content-type": "application/json"}


def _json_bytes(body: dict) -> bytes:
    """`body` as JSON bytes: orjson (~20x faster than json.dumps on a few hundred token ids: the
    largest part of a request's client CPU after the HTTP stack, issue 37), or json.dumps when a
    sampling parameter is a non-finite float (orjson would write null where json writes the NaN /
    Infinity literal that the engine refuses with a 400 naming it) or orjson cannot encode it."""
    params = body["sampling_params"].values()
    if not any(isinstance(v, float) and not math.isfinite(v) for v in params):
        try:
            return orjson.dumps(body)
        except orjson.JSONEncodeError:  # e.g. an integer past 64 bits: json writes it exactly
            pass
    return json.dumps(body).encode()
