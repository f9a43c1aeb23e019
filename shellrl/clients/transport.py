"""httpx transport on aiohttp: the clients' code stays httpx, the HTTP/1.1 work is aiohttp's.

Why: `EngineClient` and `SandboxClient` make two calls per agent turn, and through httpx's own
transport (httpcore + anyio) each costs ~2-4 ms of client CPU on this VM (httpcore walks every
pooled connection per request; anyio asks the socket for its peer each time), which capped the
gateway at 182-184 turns/s on the idle VM (47-74 under load); through this transport the same
benchmark gives 703-729 (BENCHMARKS.md, "Rollout gateway"; `python -m benchmarks rollout`).

Why not the `httpx-aiohttp` package: it maps aiohttp's `ServerDisconnectedError` (the server
dropped the connection, maybe after running the request) to `httpx.ConnectTimeout`, which
`EngineClient` treats as "never reached the server" and would re-send a generate that may have
run. This module's mapping keeps httpx's meaning of every exception, which the clients' retry
rules depend on:

| aiohttp                                          | httpx                 | request may have run |
|--------------------------------------------------|-----------------------|----------------------|
| `ConnectionTimeoutError` (pool wait or connect)  | `ConnectTimeout`      | no                   |
| `ClientConnectorError` (refused, DNS, ...)       | `ConnectError`        | no                   |
| `ServerTimeoutError` / `asyncio.TimeoutError`    | `ReadTimeout`         | yes                  |
| `ServerDisconnectedError`, `ClientResponseError` | `RemoteProtocolError` | yes                  |
| `ClientPayloadError`, `ClientOSError`            | `ReadError`           | yes                  |
| any other `ClientError`                          | `TransportError`      | yes                  |

The "no" rows hold for POST, which is every call that must not run twice (/generate, /exec, session
creation, weight updates): aiohttp re-sends only idempotent methods (GET, HEAD, OPTIONS, TRACE, PUT,
DELETE), once, when their connection broke (aiohttp/client.py), so a GET or DELETE that reached the
server and lost its connection can come back as `ConnectError` from the re-send.

Timeouts come from httpx's per-request `timeout`: connect + pool -> aiohttp `connect` (waiting for a
pooled connection and opening one), connect -> `sock_connect`, read -> `sock_read`; httpx's `write`
has no aiohttp counterpart, and a timeout of 0 means none to aiohttp. Responses are read whole (no
streaming), not decompressed by aiohttp (httpx decodes per Content-Encoding); redirects and cookies
are left to httpx.

`auth_headers(api_token)` is the header every client sends to every service of its stack
(shellrl/service/auth.py): `Authorization: Bearer <token>`, SGLang's `--api-key` header too.
"""

from __future__ import annotations

import asyncio

import aiohttp
import httpx

# uvicorn closes an idle keep-alive connection after 5 s (its `timeout_keep_alive`); dropping ours a
# second earlier makes a request going out on a connection the server is closing rare (it then fails
# as RemoteProtocolError, "may have run", and is not re-sent).
KEEPALIVE_TIMEOUT_S = 4.0
_SKIP_HEADERS = frozenset({"content-length", "transfer-encoding", "host"})


def auth_headers(api_token: str | None) -> dict[str, str]:
    """`{"Authorization": "Bearer <api_token>"}` for a client's default headers; `{}` when
    `api_token` is None or empty (the service runs with auth disabled)."""
    return {"Authorization": f"Bearer {api_token}"} if api_token else {}


class AiohttpTransport(httpx.AsyncBaseTransport):
    """`httpx.AsyncClient(transport=AiohttpTransport(max_connections=256))`.

    max_connections: open connections in all (aiohttp's `limit`; 0 = unbounded); a request waits
    for a free one up to its connect + pool timeout. The aiohttp session is created on the first
    request, in the running event loop (again when used from another loop), and closed by `aclose()`
    (httpx calls it from `AsyncClient.aclose`).
    """

    def __init__(
        self, max_connections: int = 100, keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S
    ) -> None:
        if max_connections < 0:
            raise ValueError(f"max_connections must be >= 0; got {max_connections}")
        self.max_connections = max_connections
        self.keepalive_timeout_s = keepalive_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._loop is not loop:
            connector = aiohttp.TCPConnector(
                limit=self.max_connections,
                limit_per_host=0,
                keepalive_timeout=self.keepalive_timeout_s,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept"),
            )
            self._loop = loop
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout") or {}
        connect_s, read_s = timeout.get("connect"), timeout.get("read")
        pool_s = timeout.get("pool")
        client_timeout = aiohttp.ClientTimeout(
            total=None,
            connect=None if connect_s is None or pool_s is None else connect_s + pool_s,
            sock_connect=connect_s,
            sock_read=read_s,
        )
        headers = [
            (k, v) for k, v in request.headers.multi_items() if k.lower() not in _SKIP_HEADERS
        ]
        body = await request.aread()
        try:
            async with self._get_session().request(
                request.method,
                str(request.url),
                headers=headers,
                data=body or None,
                allow_redirects=False,
                timeout=client_timeout,
            ) as response:
                content = await response.read()
                status, raw_headers, reason = response.status, response.raw_headers, response.reason
        except aiohttp.ConnectionTimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc) or "timed out connecting", request=request) from exc
        except aiohttp.ClientConnectorError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise httpx.ReadTimeout(
                str(exc) or "timed out reading the response", request=request
            ) from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientResponseError) as exc:
            raise httpx.RemoteProtocolError(
                str(exc) or type(exc).__name__, request=request
            ) from exc
        except (aiohttp.ClientPayloadError, aiohttp.ClientOSError) as exc:
            raise httpx.ReadError(str(exc) or type(exc).__name__, request=request) from exc
        except aiohttp.ClientError as exc:
            raise httpx.TransportError(f"{type(exc).__name__}: {exc}", request=request) from exc
        return httpx.Response(
            status,
            headers=list(raw_headers),
            content=content,
            request=request,
            extensions={
                "http_version": b"HTTP/1.1",
                "reason_phrase": (reason or "").encode("latin-1", "replace"),
            },
        )

    async def aclose(self) -> None:
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = self._loop = None
