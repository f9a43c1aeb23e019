"""Which failed engine calls are sent again, and how (tenacity): `EngineClient`'s one retry rule.

Only a request that provably never ran is sent again: after a connect error or a connect timeout
(it never reached the server), or, for `generate`, when shellrl's engine answered 503
`shutting_down` while it drains (the caller raises `Resend` for that). A request that may have run
(read timeout, dropped connection, any other HTTP status) is never re-sent. At most `retries` extra
attempts; the n-th re-send after a connect failure waits n x `backoff_s` seconds, a re-send after a
refusal goes at once. Out of attempts, the caller gets the `EngineUnavailable` of the last attempt.
"""

from __future__ import annotations

import httpx
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt

from shellrl.clients.engine_responses import EngineUnavailable


class Resend(Exception):
    """The request never ran and may be sent again. `error`: what the caller gets when it may not
    (out of attempts). `backoff`: wait before the next attempt (False: send it again at once)."""

    def __init__(self, error: EngineUnavailable, *, backoff: bool) -> None:
        super().__init__(str(error))
        self.error, self.backoff = error, backoff


async def send_once(
    http: httpx.AsyncClient, method: str, url: str, path: str, **kwargs
) -> httpx.Response:
    """One HTTP call to `url + path`; the response whatever its status. Raises Resend (connect error
    or connect timeout), EngineUnavailable (no answer in time: `timed_out`; connection lost)."""
    try:
        return await http.request(method, url + path, **kwargs)
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached the server
        error = EngineUnavailable(url, f"cannot connect ({type(exc).__name__}: {exc})")
        raise Resend(error, backoff=True) from exc
    except httpx.TimeoutException as exc:
        raise EngineUnavailable(
            url, f"no answer in time ({type(exc).__name__})", timed_out=True
        ) from exc
    except httpx.TransportError as exc:  # the request may have run: never re-sent
        raise EngineUnavailable(url, f"connection lost ({type(exc).__name__}: {exc})") from exc


def resends(retries: int, backoff_s: float) -> AsyncRetrying:
    """The attempts of one call: `async for attempt in resends(...): with attempt: ...`. A `Resend`
    is retried up to `retries` more times, then its `error` is raised (with the connect error as
    its cause); any other exception is raised at once."""

    def wait_s(state: RetryCallState) -> float:
        return backoff_s * state.attempt_number if state.outcome.exception().backoff else 0.0

    return AsyncRetrying(
        retry=retry_if_exception_type(Resend),
        stop=stop_after_attempt(retries + 1),
        wait=wait_s,
        retry_error_callback=_give_up,
    )


def _give_up(state: RetryCallState):
    resend = state.outcome.exception()
    raise resend.error from resend.__cause__
