"""A fleet of engines: connections, its members and which of them take `generate` traffic
(`engine_routing.EngineRouting`: membership changes at run time, load, stale and suspect marks),
one HTTP call with the retry rule (`engine_retry`), and the control calls (weight sync,
pause/continue, abort, flush, info, health) that fan out to every member concurrently and return
`{url: result}`.

`EngineFleet` is the base of `shellrl.clients.engine.EngineClient`, which adds the routed
`generate`; that module's docstring describes routing, retries and errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from typing import Any, Self

import httpx

from shellrl.clients.engine_responses import (
    EngineError,
    EngineUnavailable,
    UpdateResult,
    body_of,
    raise_on_failure,
)
from shellrl.clients.engine_retry import resends, send_once
from shellrl.clients.engine_routing import EngineRouting
from shellrl.clients.transport import AiohttpTransport, auth_headers

ADMIN_PATHS = frozenset(
    {
        "/abort_request",
        "/begin_weight_update",
        "/continue_generation",
        "/destroy_weights_update_group",
        "/end_weight_update",
        "/flush_cache",
        "/init_weights_update_group",
        "/pause_generation",
        "/update_weight_version",
        "/update_weights_from_disk",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
    }
)
"""The routes this client calls that SGLang 0.5.23 marks `AuthLevel.ADMIN_OPTIONAL`
(sglang/srt/entrypoints/http_server.py; sglang/srt/utils/auth.py `decide_request_auth`): with
`--admin-api-key` set they need `Authorization: Bearer <admin key>` and refuse the `--api-key`.
tests/service/test_sglang_conformance.py reads the levels from the wheel's source."""
DEFAULT_TIMEOUT_S = 600.0  # a long CPU generation or a whole-model weight update
DEFAULT_CONNECT_TIMEOUT_S = 5.0


class EngineFleet:
    """SGLang HTTP calls to one or more engine URLs (see the module docstring)."""

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
        api_token: str | None = None,
        admin_api_token: str | None = None,
        route_wait_s: float = 0.0,
        allow_empty: bool = False,
    ) -> None:
        """urls: the seed members. api_token: the bearer token of every call (SGLang's
        `--api-key`). admin_api_token: SGLang's `--admin-api-key`, sent instead on ADMIN_PATHS
        (None: api_token there too). route_wait_s: how long a `generate` waits for a routable
        engine when none is (EngineRouting). allow_empty: start with no member (the gateway's
        directory adds registered engines); else ValueError for an empty list."""
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls and not allow_empty:
            raise ValueError("EngineClient needs at least one engine URL")
        if connect_retries < 0:
            raise ValueError("connect_retries must be >= 0")
        self.routing = EngineRouting(urls, route_wait_s=route_wait_s)
        self.connect_retries, self.retry_backoff_s = connect_retries, retry_backoff_s
        self._session_supported: dict[str, bool] = {}
        # HTTP/1.1 through aiohttp under httpx's API: ~3x less client CPU per call than httpx's own
        # transport, with httpx's exception meanings kept (shellrl/clients/transport.py). A `transport`
        # given by the caller brings its own connection limit (max_connections is not used then).
        # api_token: the stack's bearer token on every call (SGLang's `--api-key` header as well)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            headers=auth_headers(api_token),
            transport=transport if transport is not None else AiohttpTransport(max_connections),
        )
        self._admin_headers = auth_headers(admin_api_token) if admin_api_token else None

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ----- routing -----------------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        """The members now (control calls without `urls=` fan out to these)."""
        return list(self.routing.urls)

    @property
    def _in_flight(self):
        return self.routing.in_flight

    def add_url(self, url: str, *, available: bool = True) -> None:
        """A new member (an engine that joined); `available`: whether it takes traffic yet."""
        self.routing.add(url, available=available)

    def remove_url(self, url: str) -> None:
        """Drop a member (an engine that left): no new call goes there."""
        self.routing.remove(url)
        self._session_supported.pop(url.rstrip("/"), None)

    def set_available(self, url: str, available: bool) -> None:
        """Take an engine out of `generate` rotation (e.g. while it loads weights) or put it back."""
        self.routing.set_available(url, available)

    def in_flight(self) -> dict[str, int]:
        """Requests in flight from this client, per member URL."""
        return {u: self.routing.in_flight[u] for u in self.routing.urls}

    def _pick(self, exclude: set[str]) -> str:
        return self.routing.pick(exclude)

    # ----- transport -----------------------------------------------------------------------------

    async def _request(self, method: str, url: str, path: str, **kwargs) -> httpx.Response:
        """One HTTP call with retries on connect errors only; raises EngineUnavailable/EngineError."""
        if self._admin_headers is not None and path in ADMIN_PATHS:
            kwargs["headers"] = {**kwargs.get("headers", {}), **self._admin_headers}
        async for attempt in resends(self.connect_retries, self.retry_backoff_s):
            with attempt:
                response = await send_once(self._http, method, url, path, **kwargs)
        if response.status_code >= 400:
            raise EngineError(url, response.status_code, body_of(response))
        return response

    async def _fan_out(
        self, method: str, path: str, urls: Iterable[str] | None, **kwargs
    ) -> dict[str, httpx.Response]:
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

    # ----- weight sync ---------------------------------------------------------------------------

    async def begin_weight_update(
        self, *, selector: str = "all", urls: Iterable[str] | None = None
    ) -> dict[str, bool]:
        """POST /begin_weight_update (SGLang 0.5.23). Returns {url: True} where a session was opened,
        {url: False} on older servers that answer 404 (they need no session)."""
        return await self._session_call("/begin_weight_update", {"selector": selector}, urls)

    async def end_weight_update(
        self, *, urls: Iterable[str] | None = None, discard: bool = False
    ) -> dict[str, bool]:
        """POST /end_weight_update; on shellrl's engine this is when staged weights become live.
        discard: shellrl's engine only (SGLang has no such field): drop the staged buckets instead,
        nothing goes live (a push abandoned mid-way)."""
        body = {"discard": True} if discard else {}
        return await self._session_call("/end_weight_update", body, urls)

    async def _session_call(
        self, path: str, body: dict, urls: Iterable[str] | None
    ) -> dict[str, bool]:
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
            raise_on_failure(url, response)
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

        serialized_named_tensors: one entry per TP rank: SGLang's envelope (`shellrl.weights.sglang`,
        base64), or for shellrl's engine only the JSON payloads of `shellrl.weights.bucket` / `.gpu`.
        flush_cache: the engine drops KV of the old weights after loading; the last bucket of a
        push must set it (SGLang keeps its radix cache otherwise). session: wrap the call in
        begin/end_weight_update (required by SGLang 0.5.23; skipped on servers without it). Pass
        session=False to send several buckets inside one session you opened yourself.
        Raises EngineError when an engine refuses (HTTP 400, `success: false`).
        """
        body = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
            "weight_version": weight_version,
        }
        targets = list(urls) if urls is not None else list(self.urls)
        if session:
            await self.begin_weight_update(urls=targets)
        try:
            responses = await self._fan_out(
                "POST", "/update_weights_from_tensor", targets, json=body
            )
        except BaseException:
            if session:  # close the session so the engine stays usable; the first error wins
                await asyncio.gather(self.end_weight_update(urls=targets), return_exceptions=True)
            raise
        results = {u: raise_on_failure(u, r) for u, r in responses.items()}
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
        body = {
            "model_path": model_path,
            "load_format": load_format,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
            "weight_version": weight_version,
        }
        responses = await self._fan_out("POST", "/update_weights_from_disk", urls, json=body)
        return {u: raise_on_failure(u, r) for u, r in responses.items()}

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        *,
        group_name: str,
        backend: str,
        urls: Iterable[str] | None = None,
    ) -> dict[str, UpdateResult]:
        """POST /init_weights_update_group: the engine joins the group as ranks rank_offset.. (the
        call returns once every rank joined, so rank 0 must join concurrently; see
        shellrl.weights.distributed). Raises EngineError when an engine refuses (400)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        responses = await self._fan_out("POST", "/init_weights_update_group", urls, json=body)
        return {u: raise_on_failure(u, r) for u, r in responses.items()}

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str,
        weight_version: str | None,
        flush_cache: bool = True,
        load_format: str | None = "flattened_bucket",
        urls: Iterable[str] | None = None,
    ) -> dict[str, UpdateResult]:
        """POST /update_weights_from_distributed: the engine receives one broadcast of these tensors
        from rank 0 (flattened bucket, SGLang's unpadded layout); inside begin/end_weight_update.
        Returns once received and loaded; raises EngineError when an engine refuses."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
            "load_format": load_format,
        }
        responses = await self._fan_out("POST", "/update_weights_from_distributed", urls, json=body)
        return {u: raise_on_failure(u, r) for u, r in responses.items()}

    async def destroy_weights_update_group(
        self, group_name: str, *, urls: Iterable[str] | None = None
    ) -> dict[str, UpdateResult]:
        """POST /destroy_weights_update_group; EngineError (400) when no such group is live."""
        responses = await self._fan_out(
            "POST", "/destroy_weights_update_group", urls, json={"group_name": group_name}
        )
        return {u: raise_on_failure(u, r) for u, r in responses.items()}

    async def get_weight_version(self, *, urls: Iterable[str] | None = None) -> dict[str, str]:
        """Each engine's weight version, read from /model_info (SGLang's supported place)."""
        infos = await self.get_model_info(urls=urls)
        return {u: str(info["weight_version"]) for u, info in infos.items()}

    # ----- generation control ----------------------------------------------------------------------

    async def pause_generation(
        self, mode: str = "abort", *, urls: Iterable[str] | None = None
    ) -> None:
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
        await self._fan_out(
            "POST", "/abort_request", urls, json={"rid": rid or "", "abort_all": abort_all}
        )

    async def flush_cache(self, *, urls: Iterable[str] | None = None) -> dict[str, str]:
        """POST /flush_cache: drops the prefix cache. EngineError (400) while requests are running, or
        waiting while generation is not paused."""
        responses = await self._fan_out("POST", "/flush_cache", urls)
        return {u: r.text for u, r in responses.items()}

    # ----- info and health ---------------------------------------------------------------------------

    async def get_model_info(self, *, urls: Iterable[str] | None = None) -> dict[str, dict]:
        """GET /model_info (falls back to /get_model_info): model_path, weight_version, ..."""
        targets = [u.rstrip("/") for u in (urls if urls is not None else self.urls)]
        infos = await asyncio.gather(
            *(self._get_with_fallback(u, "/model_info", "/get_model_info") for u in targets)
        )
        return dict(zip(targets, infos))

    async def get_server_info(self, *, urls: Iterable[str] | None = None) -> dict[str, dict]:
        """GET /server_info (falls back to /get_server_info): the server's resolved arguments."""
        targets = [u.rstrip("/") for u in (urls if urls is not None else self.urls)]
        infos = await asyncio.gather(
            *(self._get_with_fallback(u, "/server_info", "/get_server_info") for u in targets)
        )
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
