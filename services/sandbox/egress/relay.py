"""The bytes of an allowed request (proxy.py decided and audited it): one plain-HTTP exchange
re-framed by h11, or a CONNECT tunnel.

`exchange`: an h11 client connection writes the request upstream from the parsed `Request`
(origin-form target, `Host` from the target, hop-by-hop headers dropped, `Connection: close`)
and then exactly Content-Length body bytes; what the client sends after them never goes upstream.
The same h11 connection parses the response; an h11 server connection writes it to the client
(status, end-to-end headers, `Connection: close`, the body re-framed), so the client gets one
well-formed response or, when the upstream's is malformed before its head was passed on, a 502.
A client waiting for `100 Continue` gets it from the proxy.

`tunnel`: `200 Connection established`, then bytes both ways as they are.

Both charge every byte (sent: written upstream; received: read from upstream) to the session's
`Budget` and stop when it is spent or when neither direction moved a byte for `idle_timeout_s`.
"""

from __future__ import annotations

import asyncio
import time

import h11

from services.sandbox.egress.head import (
    HOP_BY_HOP,
    READ_BYTES,
    Refusal,
    Request,
    authority,
    content_length,
    send_error,
)


class Budget:
    """The bytes one connection may still move (the session's `bytes_left`, shared by all of
    its connections) and when it last moved one."""

    def __init__(self, state, idle_timeout_s: float) -> None:
        self.state, self.idle_timeout_s = state, idle_timeout_s
        self.sent = self.received = 0
        self.active_at = time.monotonic()

    def count(self, direction: str, n: int) -> bool:
        """Charge `n` bytes; False (and nothing charged) when that would pass the budget."""
        if n > self.state.bytes_left:
            self.state.bytes_used = self.state.policy.max_bytes
            return False
        self.state.bytes_used += n
        self.active_at = time.monotonic()
        setattr(self, direction, getattr(self, direction) + n)
        return True

    async def read(self, src: asyncio.StreamReader, n: int = READ_BYTES) -> bytes:
        """At most `n` bytes (and at most what the budget has left, but one); TimeoutError when
        neither direction moved a byte for idle_timeout_s."""
        while True:
            try:
                async with asyncio.timeout(self.idle_timeout_s):
                    return await src.read(min(n, max(self.state.bytes_left, 1)))
            except TimeoutError:
                if time.monotonic() - self.active_at >= self.idle_timeout_s:
                    raise  # else the other direction is busy: keep waiting

    async def write(self, dst: asyncio.StreamWriter, data: bytes, direction: str) -> bool:
        if not data:
            return True
        if not self.count(direction, len(data)):
            return False
        dst.write(data)
        await dst.drain()
        return True


async def exchange(request: Request, rest: bytes, reader, writer, up_reader, up_writer, budget):
    """One request up, one response down (`rest`: body bytes read with the head). A client that
    ends before its Content-Length did gets 400 (when no answer started) and the upstream's
    connection is closed: it never waits for a body that cannot come."""
    ex = _Exchange(request, writer, up_writer, budget)
    if ex.downstream.they_are_waiting_for_100_continue:
        writer.write(ex.downstream.send(h11.InformationalResponse(status_code=100, headers=[])))
    if not await budget.write(up_writer, ex.request_head(), "sent"):
        return
    length = content_length(request.headers)
    body = asyncio.create_task(ex.send_body(reader, rest[:length], length))
    response = asyncio.create_task(ex.relay_response(up_reader))
    try:
        await asyncio.wait({body, response}, return_when=asyncio.FIRST_COMPLETED)
        cut_short = body.done() and not body.cancelled() and body.exception() is None
        if not response.done() and cut_short and body.result() == "client_ended":
            response.cancel()
            if not ex.answered:
                message = f"the connection ended before the {length}-byte body did"
                await send_error(writer, Refusal(400, "incomplete_body", message))
            return
        await response
    finally:
        for task in (body, response):
            task.cancel()
        await asyncio.gather(body, response, return_exceptions=True)


class _Exchange:
    """The two h11 connections of one exchange: `upstream` (the proxy as the upstream's client)
    and `downstream` (the proxy as the client's server, fed the head parse_head accepted)."""

    def __init__(self, request: Request, writer, up_writer, budget: Budget) -> None:
        self.request, self.writer, self.up_writer, self.budget = request, writer, up_writer, budget
        self.upstream, self.downstream = h11.Connection(h11.CLIENT), h11.Connection(h11.SERVER)
        self.downstream.receive_data(request.head)
        self.downstream.next_event()  # the h11.Request parse_head accepted
        self.answered = False  # the response head went to the client

    def request_head(self) -> bytes:
        """The request head for the upstream (header values as the client sent their bytes:
        obs-text included)."""
        headers = [(b"Host", authority(self.request).encode("ascii"))]
        headers += [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in self.request.headers
            if k.lower() not in HOP_BY_HOP
        ]
        headers.append((b"Connection", b"close"))
        method, target = self.request.method, self.request.target
        return self.upstream.send(h11.Request(method=method, target=target, headers=headers))

    async def send_body(self, reader, prefix: bytes, length: int) -> str:
        """Exactly `length` bytes, then the end of the message: "done", "client_ended" or
        "budget" (the session's bytes are spent)."""
        left = length
        while left > 0:
            data = prefix or await self.budget.read(reader, min(READ_BYTES, left))
            prefix = b""
            if not data:
                return "client_ended"
            data = data[:left]
            out = self.upstream.send(h11.Data(data=data))
            if not await self.budget.write(self.up_writer, out, "sent"):
                return "budget"
            left -= len(data)
        await self.budget.write(self.up_writer, self.upstream.send(h11.EndOfMessage()), "sent")
        return "done"

    async def relay_response(self, up_reader) -> None:
        """The upstream's response, event by event, to the client; 502 when it is malformed (or
        missing) before its head was passed on."""
        while True:
            try:
                event = self.upstream.next_event()
                if isinstance(event, h11.ConnectionClosed):
                    raise h11.RemoteProtocolError("the upstream closed the connection")
                out = _reframe(event, self.downstream)
            except h11.ProtocolError as exc:
                if not self.answered:
                    refusal = Refusal(502, "bad_upstream_response", str(exc)[:500])
                    await send_error(self.writer, refusal)
                return
            if event is h11.NEED_DATA:
                data = await self.budget.read(up_reader)
                if data and not self.budget.count("received", len(data)):
                    return
                self.upstream.receive_data(data)  # b"": the upstream closed
                continue
            if out is None:
                continue  # 1xx: nothing asked for one (Expect and Upgrade are not forwarded)
            self.answered = True
            self.writer.write(out)
            await self.writer.drain()
            if isinstance(event, h11.EndOfMessage):
                return


def _reframe(event, downstream: h11.Connection) -> bytes | None:
    """The client's bytes for an event of the upstream's response (None: nothing to send)."""
    if isinstance(event, h11.Response):
        headers = [
            (k, v) for k, v in event.headers.raw_items() if k.lower().decode() not in HOP_BY_HOP
        ]
        headers.append((b"Connection", b"close"))
        event = h11.Response(status_code=event.status_code, headers=headers, reason=event.reason)
    elif isinstance(event, h11.Data):
        event = h11.Data(data=event.data)
    elif not isinstance(event, h11.EndOfMessage):
        return None  # NEED_DATA, 1xx
    return downstream.send(event)


async def tunnel(rest: bytes, reader, writer, up_reader, up_writer, budget: Budget) -> None:
    """CONNECT: the 200, `rest` (bytes the client sent after the head) and then both ways."""
    writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
    await writer.drain()
    if not await budget.write(up_writer, rest, "sent"):
        return
    await asyncio.gather(
        _copy(reader, up_writer, budget, "sent"), _copy(up_reader, writer, budget, "received")
    )


async def _copy(src, dst, budget: Budget, direction: str) -> None:
    """Copy `src` → `dst` until EOF, the budget's end or idleness; half-closes `dst` at EOF."""
    try:
        while data := await budget.read(src):
            if not await budget.write(dst, data, direction):
                break
        if dst.can_write_eof():
            dst.write_eof()
    except (ConnectionError, TimeoutError, OSError):
        dst.close()
