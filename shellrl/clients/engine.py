"""Async client for SGLang's HTTP API (a real SGLang server or shellrl's CPU engine `services/engine`).

Used by the rollout service (`generate`) and the learner (weight sync, pause/continue). Field names
and formats follow SGLang 0.5.23; see docs/sglang.md for each field and its source path.

Routing: `generate` goes to the available engine with the fewest requests in flight from this
client (ties broken round-robin), or to `url=` when given (e.g. to keep an episode on the engine
that holds its prefix in cache). Control calls (weight updates, pause, abort, flush, info) fan out
to every configured engine (or `urls=`) concurrently, because in SGLang deployments they go to each
engine directly, never through a router, and return `{url: result}`.

Retries: only on errors where the request provably never ran (connect errors, connect timeouts,
and shellrl's engine answering 503 `shutting_down` while it drains), at most `connect_retries`
extra attempts with a growing pause; a `generate` retry may go to another engine. A request that
may have run (read timeout, dropped connection, any other HTTP status) is never re-sent: the caller
gets `EngineUnavailable` or `EngineError`.

Errors: `EngineUnavailable` (cannot connect, or no answer within the timeout), `EngineError`
(HTTP 4xx/5xx, or a response that breaks the contract; carries `status`, `body`, `url`).
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from shellrl.clients.transport import AiohttpTransport

DEFAULT_TIMEOUT_S = 600.0  # a long CPU generation or a whole-model weight update
DEFAULT_CONNECT_TIMEOUT_S = 5.0


class EngineUnavailable(Exception):
    """The engine could not be reached, or did not answer within the timeout (`timed_out`)."""

    def __init__(self, url: str, message: str, *, timed_out: bool = False) -> None:
        super().__init__(f"{url}: {message}")
        self.url, self.timed_out = url, timed_out


class EngineError(Exception):
    """The engine answered with HTTP 4xx/5xx, or with a body that breaks the contract."""

    def __init__(self, url: str, status: int, body: Any, message: str | None = None) -> None:
        super().__init__(f"{url}: HTTP {status}: {message or _error_text(body)}")
        self.url, self.status, self.body = url, status, body


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens `[start, end)` of one response were generated with weights `version`."""

    version: str
    start: int
    end: int


@dataclass(frozen=True)
class GenerateResult:
    """One `/generate` answer, checked: `output_ids[i]` was sampled with log-prob `output_logprobs[i]`.

    finish_reason: "stop" (EOS, stop token or stop string; `matched_stop` is the int token id or the
    str stop string), "length" (max_new_tokens reached), or "abort" (aborted; the tokens so far are
    kept). output_logprobs: float log-probs, `log_softmax(logits / temperature)` of each sampled
    token over the full vocabulary (before top-p/top-k), the raw distribution for greedy requests;
    empty when `return_logprob` was false. weight_version: the engine's version when the response
    ended; `weight_versions` says which version produced which tokens when an update landed mid-way.
    """

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    matched_stop: int | str | None
    weight_version: str
    prompt_tokens: int
    completion_tokens: int
    text: str
    engine_url: str
    rid: str = ""
    cached_tokens: int = 0
    weight_versions: tuple[VersionSpan, ...] = field(default_factory=tuple)
    e2e_latency_s: float | None = None


@dataclass(frozen=True)
class UpdateResult:
    """Answer of a weight-update call: `{"success": bool, "message": str}`."""

    success: bool
    message: str


class EngineClient:
    """SGLang HTTP client over one or more engine URLs (see the module docstring)."""

    def __init__(
        self,
        urls: Sequence[str] | str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        connect_retries: int = 3,
        retry_backoff_s: float = 0.25,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("EngineClient needs at least one engine URL")
        if connect_retries < 0:
            raise ValueError("connect_retries must be >= 0")
        self.urls: list[str] = [u.rstrip("/") for u in urls]
        self.connect_retries, self.retry_backoff_s = connect_retries, retry_backoff_s
        self._in_flight = {u: 0 for u in self.urls}
        self._available = {u: True for u in self.urls}
        self._tie_break = itertools.count()
        self._session_supported: dict[str, bool] = {}
        # HTTP/1.1 through aiohttp under httpx's API: ~3x less client CPU per call than httpx's own
        # transport, with httpx's exception meanings kept (shellrl/clients/transport.py). A `transport`
        # given by the caller brings its own connection limit (max_connections is not used then).
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            transport=transport if transport is not None else AiohttpTransport(max_connections),
        )

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ----- routing -----------------------------------------------------------------------------

    def set_available(self, url: str, available: bool) -> None:
        """Take an engine out of `generate` rotation (e.g. while it loads weights) or put it back."""
        url = url.rstrip("/")
        if url not in self._available:
            raise KeyError(f"unknown engine URL {url!r}; known: {self.urls}")
        self._available[url] = available

    def in_flight(self) -> dict[str, int]:
        """Requests in flight from this client, per engine URL."""
        return dict(self._in_flight)

    def _pick(self, exclude: set[str]) -> str:
        candidates = [u for u in self.urls if self._available[u] and u not in exclude]
        if not candidates:
            candidates = [u for u in self.urls if self._available[u]]
        if not candidates:
            raise EngineUnavailable(",".join(self.urls), "no engine is available (all marked out of rotation)")
        low = min(self._in_flight[u] for u in candidates)
        tied = [u for u in candidates if self._in_flight[u] == low]
        return tied[next(self._tie_break) % len(tied)]

    # ----- transport -----------------------------------------------------------------------------

    async def _request(self, method: str, url: str, path: str, **kwargs) -> httpx.Response:
        """One HTTP call with retries on connect errors only; raises EngineUnavailable/EngineError."""
        for attempt in itertools.count():
            try:
                response = await self._http.request(method, url + path, **kwargs)
                break
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                if attempt >= self.connect_retries:
                    raise EngineUnavailable(url, f"cannot connect ({type(exc).__name__}: {exc})") from exc
                await asyncio.sleep(self.retry_backoff_s * (attempt + 1))
            except httpx.TimeoutException as exc:
                raise EngineUnavailable(url, f"no answer in time ({type(exc).__name__})", timed_out=True) from exc
            except httpx.TransportError as exc:  # the request may have run: never re-sent
                raise EngineUnavailable(url, f"connection lost ({type(exc).__name__}: {exc})") from exc
        if response.status_code >= 400:
            raise EngineError(url, response.status_code, _body(response))
        return response

    async def _fan_out(self, method: str, path: str, urls: Iterable[str] | None, **kwargs) -> dict[str, httpx.Response]:
        """The same call to every engine concurrently; raises the first failure after all finished."""
        targets = [u.rstrip("/") for u in (urls if urls is not None else self.urls)]
        results = await asyncio.gather(
            *(self._request(method, u, path, **kwargs) for u in targets), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return dict(zip(targets, results))

    async def _get_with_fallback(self, url: str, path: str, old_path: str) -> Any:
        """GET `path`, or `old_path` on servers that predate it (404)."""
        try:
            return (await self._request("GET", url, path)).json()
        except EngineError as exc:
            if exc.status != 404:
                raise
            return (await self._request("GET", url, old_path)).json()

    # ----- generation ----------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict,
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        url: str | None = None,
    ) -> GenerateResult:
        """POST /generate for one token-in/token-out request.

        input_ids: prompt token ids (non-empty). sampling_params: SGLang names (temperature, top_p,
        top_k, max_new_tokens, stop, stop_token_ids, no_stop_trim, skip_special_tokens, ...).
        rid: request id for `abort_request` (a uuid4 hex when None). url: pin to one engine.
        Raises EngineUnavailable, EngineError (including 400 for bad input).
        """
        rid = rid or uuid.uuid4().hex
        body = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                "return_logprob": return_logprob, "rid": rid}
        tried: set[str] = set()
        for attempt in itertools.count():
            target = url.rstrip("/") if url else self._pick(tried)
            tried.add(target)
            self._in_flight[target] += 1
            try:
                response = await self._http.post(target + "/generate", json=body)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:  # never reached the server
                if attempt >= self.connect_retries:
                    raise EngineUnavailable(target, f"cannot connect ({type(exc).__name__}: {exc})") from exc
                await asyncio.sleep(self.retry_backoff_s * (attempt + 1))
                continue
            except httpx.TimeoutException as exc:
                raise EngineUnavailable(target, f"no answer in time ({type(exc).__name__})", timed_out=True) from exc
            except httpx.TransportError as exc:
                raise EngineUnavailable(target, f"connection lost ({type(exc).__name__}: {exc})") from exc
            finally:
                self._in_flight[target] -= 1
            if response.status_code == 503 and _error_code(_body(response)) == "shutting_down":
                # shellrl's engine refused it while draining for SIGTERM: it never ran, so it goes to
                # another engine (or, pinned, is reported like an engine that cannot be reached)
                if url or attempt >= self.connect_retries or len(tried) >= len(self.urls):
                    raise EngineUnavailable(target, "engine is shutting down")
                continue
            if response.status_code >= 400:
                raise EngineError(target, response.status_code, _body(response))
            return parse_generate_response(response.json(), engine_url=target, return_logprob=return_logprob,
                                           prompt_tokens=len(input_ids))
        raise AssertionError("unreachable")

    # ----- weight sync ---------------------------------------------------------------------------

    async def begin_weight_update(self, *, selector: str = "all", urls: Iterable[str] | None = None) -> dict[str, bool]:
        """POST /begin_weight_update (SGLang 0.5.23). Returns {url: True} where a session was opened,
        {url: False} on older servers that answer 404 (they need no session)."""
        return await self._session_call("/begin_weight_update", {"selector": selector}, urls)

    async def end_weight_update(self, *, urls: Iterable[str] | None = None) -> dict[str, bool]:
        """POST /end_weight_update; on shellrl's engine this is when staged weights become live."""
        return await self._session_call("/end_weight_update", {}, urls)

    async def _session_call(self, path: str, body: dict, urls: Iterable[str] | None) -> dict[str, bool]:
        targets = [u.rstrip("/") for u in (urls if urls is not None else self.urls)]

        async def one(url: str) -> bool:
            if self._session_supported.get(url) is False:
                return False
            try:
                response = await self._request("POST", url, path, json=body)
            except EngineError as exc:
                if exc.status == 404:
                    self._session_supported[url] = False
                    return False
                raise
            self._session_supported[url] = True
            _raise_on_failure(url, response)
            return True

        results = await asyncio.gather(*(one(u) for u in targets), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return dict(zip(targets, results))

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        weight_version: str | None,
        load_format: str | None = "flattened_bucket",
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        session: bool = True,
        urls: Iterable[str] | None = None,
    ) -> dict[str, UpdateResult]:
        """POST /update_weights_from_tensor to every engine (or `urls`).

        serialized_named_tensors: one entry per TP rank; for shellrl's engine the JSON strings of
        `shellrl.weights.bucket` (shared memory or CUDA IPC buckets). session: wrap the call in
        begin/end_weight_update (required by SGLang 0.5.23; skipped on servers without it). Pass
        session=False to send several buckets inside one session you opened yourself.
        Raises EngineError when an engine refuses (HTTP 400, `success: false`).
        """
        body = {"serialized_named_tensors": list(serialized_named_tensors), "load_format": load_format,
                "flush_cache": flush_cache, "abort_all_requests": abort_all_requests, "weight_version": weight_version}
        targets = list(urls) if urls is not None else list(self.urls)
        if session:
            await self.begin_weight_update(urls=targets)
        try:
            responses = await self._fan_out("POST", "/update_weights_from_tensor", targets, json=body)
        except BaseException:
            if session:  # close the session so the engine stays usable; the first error wins
                await asyncio.gather(self.end_weight_update(urls=targets), return_exceptions=True)
            raise
        results = {u: _raise_on_failure(u, r) for u, r in responses.items()}
        if session:
            await self.end_weight_update(urls=targets)
        return results

    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None,
        *,
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
        urls: Iterable[str] | None = None,
    ) -> dict[str, UpdateResult]:
        """POST /update_weights_from_disk: every engine loads the safetensors checkpoint in
        `model_path` (a directory the engines can read). Raises EngineError on `success: false`."""
        body = {"model_path": model_path, "load_format": load_format, "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests, "weight_version": weight_version}
        responses = await self._fan_out("POST", "/update_weights_from_disk", urls, json=body)
        return {u: _raise_on_failure(u, r) for u, r in responses.items()}

    async def get_weight_version(self, *, urls: Iterable[str] | None = None) -> dict[str, str]:
        """Each engine's weight version, read from /model_info (SGLang's supported place)."""
        infos = await self.get_model_info(urls=urls)
        return {u: str(info["weight_version"]) for u, info in infos.items()}

    # ----- generation control ----------------------------------------------------------------------

    async def pause_generation(self, mode: str = "abort", *, urls: Iterable[str] | None = None) -> None:
        """POST /pause_generation {"mode": "abort"|"retract"|"in_place"}; new requests wait until
        continue. In "abort" mode in-flight requests have returned their partial output when this returns."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"mode must be abort, retract or in_place, not {mode!r}")
        await self._fan_out("POST", "/pause_generation", urls, json={"mode": mode})

    async def continue_generation(self, *, urls: Iterable[str] | None = None) -> None:
        """POST /continue_generation {}: waiting and paused requests run again."""
        await self._fan_out("POST", "/continue_generation", urls, json={})

    async def abort_request(
        self, rid: str | None = None, abort_all: bool = False, *, urls: Iterable[str] | None = None
    ) -> None:
        """POST /abort_request: aborts everything, or, if a request with exactly this `rid` is live,
        every live request whose rid starts with `rid` (SGLang 0.5.23 and shellrl's engine alike); a
        batch's parent rid is never live itself, so it aborts nothing: abort `rid_0`, `rid_1`, ...
        The aborted `/generate` calls return their partial output with finish_reason "abort"."""
        if not rid and not abort_all:
            raise ValueError("give a rid or abort_all=True")
        await self._fan_out("POST", "/abort_request", urls, json={"rid": rid or "", "abort_all": abort_all})

    async def flush_cache(self, *, urls: Iterable[str] | None = None) -> dict[str, str]:
        """POST /flush_cache: drops the prefix cache. EngineError (400) while requests are running, or
        waiting while generation is not paused."""
        responses = await self._fan_out("POST", "/flush_cache", urls)
        return {u: r.text for u, r in responses.items()}

    # ----- info and health ---------------------------------------------------------------------------

    async def get_model_info(self, *, urls: Iterable[str] | None = None) -> dict[str, dict]:
        """GET /model_info (falls back to /get_model_info): model_path, weight_version, ..."""
        targets = [u.rstrip("/") for u in (urls if urls is not None else self.urls)]
        infos = await asyncio.gather(*(self._get_with_fallback(u, "/model_info", "/get_model_info") for u in targets))
        return dict(zip(targets, infos))

    async def get_server_info(self, *, urls: Iterable[str] | None = None) -> dict[str, dict]:
        """GET /server_info (falls back to /get_server_info): the server's resolved arguments."""
        targets = [u.rstrip("/") for u in (urls if urls is not None else self.urls)]
        infos = await asyncio.gather(*(self._get_with_fallback(u, "/server_info", "/get_server_info") for u in targets))
        return dict(zip(targets, infos))

    async def health(self, *, urls: Iterable[str] | None = None) -> dict[str, bool]:
        """GET /health per engine: True on 200; False on any error status or when unreachable."""
        return await self._probe("/health", urls)

    async def health_generate(self, *, urls: Iterable[str] | None = None) -> dict[str, bool]:
        """GET /health_generate per engine: True when a one-token generation ran."""
        return await self._probe("/health_generate", urls)

    async def _probe(self, path: str, urls: Iterable[str] | None) -> dict[str, bool]:
        targets = [u.rstrip("/") for u in (urls if urls is not None else self.urls)]

        async def one(url: str) -> bool:
            try:
                await self._request("GET", url, path)
                return True
            except (EngineError, EngineUnavailable):
                return False

        return dict(zip(targets, await asyncio.gather(*(one(u) for u in targets))))


# ----- response parsing (pure; shared with tests) ----------------------------------------------------


def parse_generate_response(
    data: dict, *, engine_url: str, return_logprob: bool, prompt_tokens: int = 0
) -> GenerateResult:
    """Checked `GenerateResult` from one `/generate` JSON object (SGLang §1.4 shape).

    Raises EngineError when the body breaks the contract: no meta_info, logprob entries that do not
    match `output_ids` one to one (sglang PR #20799 class of bug), or an unknown finish reason.
    """
    meta = data.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineError(engine_url, 200, data, "response has no meta_info")
    output_ids = [int(t) for t in data.get("output_ids") or []]
    finish = meta.get("finish_reason") or {}
    reason = finish.get("type")
    if reason not in ("stop", "length", "abort"):
        raise EngineError(engine_url, 200, data, f"unknown finish_reason {finish!r}")
    logprobs: list[float] = []
    if return_logprob:
        entries = meta.get("output_token_logprobs") or []
        if len(entries) != len(output_ids) or any(int(e[1]) != t for e, t in zip(entries, output_ids)):
            raise EngineError(engine_url, 200, data,
                              f"output_token_logprobs ({len(entries)}) do not match output_ids ({len(output_ids)})")
        logprobs = [float(e[0]) for e in entries]
    version = str(meta.get("weight_version", "default"))
    spans = tuple(VersionSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in meta.get("weight_versions") or ())
    if not spans and output_ids:
        spans = (VersionSpan(version, 0, len(output_ids)),)
    latency = meta.get("e2e_latency")
    return GenerateResult(
        output_ids=output_ids,
        output_logprobs=logprobs,
        finish_reason=reason,
        matched_stop=finish.get("matched"),
        weight_version=version,
        prompt_tokens=int(meta.get("prompt_tokens", prompt_tokens)),
        completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
        text=data.get("text", ""),
        engine_url=engine_url,
        rid=str(meta.get("id", "")),
        cached_tokens=int(meta.get("cached_tokens", 0)),
        weight_versions=spans,
        e2e_latency_s=float(latency) if latency is not None else None,
    )


def _raise_on_failure(url: str, response: httpx.Response) -> UpdateResult:
    data = _body(response)
    if not isinstance(data, dict) or not data.get("success", False):
        raise EngineError(url, response.status_code, data, f"update failed: {_error_text(data)}")
    return UpdateResult(success=True, message=str(data.get("message", "")))


def _body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _error_code(body: Any) -> str | None:
    """shellrl's `{"error": {"code"}}`; None for other bodies."""
    error = body.get("error") if isinstance(body, dict) else None
    return error.get("code") if isinstance(error, dict) else None


def _error_text(body: Any) -> str:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            return str(error.get("message", error))
        if error is not None:
            return str(error)
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return str(body)[:500]
