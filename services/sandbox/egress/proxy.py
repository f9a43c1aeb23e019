"""The egress proxy: one client connection from a session's door (doors.py) → one request.

Consumes an HTTP/1.x request head (at most `max_header_bytes`, all of it within
`header_timeout_s`: a slow sender gets 408, a huge head 431), asks the session's `EgressPolicy`
(rules.py) and its rate and byte limits, writes the verdict to the audit log (audit.py), then:

* `CONNECT host:port` → a TCP tunnel (HTTPS; no TLS interception: the host and port are checked,
  the path and method inside the tunnel cannot be);
* `METHOD http://host[:port]/path` (absolute form) → the request is sent upstream in origin form
  with `Host` set to the target and `Connection: close`, its body (Content-Length only; a chunked
  request body gets 411) and the response are copied, and the connection closes: one request per
  connection, so a second request can never ride on a checked one.

Refusals are `HTTP/1.1 <status>` with a JSON body `{"error": {"code", "message", "rule"}}` and
the connection closed. Host names are resolved here, on the host; an internal address (loopback,
private, link-local) is reached only for a rule naming it literally (rules.py), and the proxy
connects to the address it checked (no second lookup to rebind). Guarantees: nothing reaches an
upstream without an allowing rule and an audit entry written first; a session's bytes through the
proxy (both directions) stop at its policy's `max_bytes`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.sandbox import metrics
from services.sandbox.egress.audit import AuditLog, EgressRecord
from services.sandbox.egress.head import (
    HOP_BY_HOP,
    Refusal,
    Request,
    authority,
    content_length,
    parse_head,
    send_error,
)
from services.sandbox.egress.rules import EgressPolicy, EgressRule, EgressVerdict, is_internal

log = logging.getLogger(__name__)
CHUNK_BYTES = 64 << 10
LINGER_BYTES = 1 << 20


@dataclass(frozen=True)
class ProxyLimits:
    """Per-connection bounds (seconds, bytes); from the sandbox settings `egress_*`."""

    header_timeout_s: float = 10.0
    max_header_bytes: int = 32 << 10
    connect_timeout_s: float = 10.0
    idle_timeout_s: float = 60.0


@dataclass
class EgressState:
    """One session's egress: its policy, its token bucket (`requests_per_minute`, refilled
    evenly, burst = one minute's worth), the bytes it has moved, and `on_denial`, called with
    each denial as a safety event of the session (the verifier's safety signal)."""

    session_id: str
    policy: EgressPolicy
    on_denial: Callable[[dict], None]
    tokens: float = 0.0
    refilled_at: float = field(default_factory=time.monotonic)
    bytes_used: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"allow": 0, "deny": 0})

    def __post_init__(self) -> None:
        self.tokens = float(self.policy.requests_per_minute)

    def take_token(self) -> bool:
        now = time.monotonic()
        rate_per_s = self.policy.requests_per_minute / 60.0
        cap = float(self.policy.requests_per_minute)
        self.tokens = min(cap, self.tokens + (now - self.refilled_at) * rate_per_s)
        self.refilled_at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True

    @property
    def bytes_left(self) -> int:
        return max(0, self.policy.max_bytes - self.bytes_used)

    def summary(self) -> dict:
        return {**self.counts, "bytes": self.bytes_used, "max_bytes": self.policy.max_bytes}


class EgressProxy:
    """Serves client connections of sessions (`handle`), each against that session's state."""

    def __init__(self, limits: ProxyLimits, audit: AuditLog) -> None:
        self.limits, self.audit = limits, audit

    async def handle(
        self, state: EgressState, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Serve one connection to its end; never raises (errors are answered or logged)."""
        try:
            await self._serve(state, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except Exception:  # a bug must not take the door down
            log.exception("egress proxy connection failed", extra={"session_id": state.session_id})
        finally:
            await _lingering_close(reader, writer)

    async def _serve(self, state, reader, writer) -> None:
        request = None
        try:
            request = parse_head(await self._read_head(reader))
            verdict, address = await self._decide(state, request)
        except asyncio.IncompleteReadError:
            return
        except Refusal as refusal:
            return await self._refuse(state, writer, request, refusal)
        try:
            await self.audit.append(_record(state, "decision", request, verdict))
        except Exception as exc:  # fail closed: nothing leaves unaudited
            log.error("egress audit write failed", extra={"error": repr(exc)})
            metrics.EGRESS_REQUESTS.labels("deny", "audit_unavailable").inc()
            message = "the egress audit log cannot be written; refused"
            return await send_error(writer, Refusal(503, "audit_unavailable", message))
        state.counts["allow"] += 1
        metrics.EGRESS_REQUESTS.labels("allow", "rule").inc()
        sent = received = 0
        try:
            try:
                async with asyncio.timeout(self.limits.connect_timeout_s):
                    up_reader, up_writer = await asyncio.open_connection(address, request.port)
            except (OSError, TimeoutError) as exc:
                await send_error(
                    writer,
                    Refusal(502, "upstream_unreachable", f"{request.host}:{request.port}: {exc!r}"),
                )
                return
            try:
                sent, received = await self._exchange(
                    state, request, reader, writer, up_reader, up_writer
                )
            finally:
                up_writer.close()
        finally:
            await self._closed(state, request, verdict, sent, received)

    async def _read_head(self, reader: asyncio.StreamReader) -> bytes:
        """The request head; Refusal 408 past header_timeout_s, 431 past max_header_bytes."""
        try:
            async with asyncio.timeout(self.limits.header_timeout_s):
                return await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            limit_s = self.limits.header_timeout_s
            raise Refusal(
                408, "header_timeout", f"request head not complete in {limit_s} s"
            ) from None
        except asyncio.LimitOverrunError:
            limit = self.limits.max_header_bytes
            raise Refusal(431, "header_too_large", f"request head over {limit} bytes") from None

    async def _decide(self, state: EgressState, request: Request) -> tuple[EgressVerdict, str]:
        """The allowing verdict and the address to connect to; Refusal otherwise."""
        verdict = self._verdict(state, request)
        if verdict.verdict != "allow":
            message = {
                "no_rule": f"no egress rule allows {request.method} {request.host}:{request.port}"
                + (f" {request.path}" if request.path else ""),
                "rate_limit": f"more than {state.policy.requests_per_minute} requests per minute",
                "byte_limit": f"the session's {state.policy.max_bytes} egress bytes are used up",
            }[verdict.reason]
            status = 403 if verdict.reason == "no_rule" else 429
            raise Refusal(status, f"egress_{verdict.reason}", message, None, verdict.reason)
        rule = state.policy.rule(verdict.rule)
        address = await self._resolve(request.host, request.port, rule)
        return verdict, address

    def _verdict(self, state: EgressState, request: Request) -> EgressVerdict:
        verdict = state.policy.evaluate(request.method, request.host, request.port, request.path)
        if verdict.verdict != "allow":
            return verdict
        if state.bytes_left <= 0:
            return EgressVerdict("deny", None, "byte_limit")
        if not state.take_token():
            return EgressVerdict("deny", None, "rate_limit")
        return verdict

    async def _resolve(self, host: str, port: int, rule: EgressRule) -> str:
        """The address to connect to: `host` looked up once (refused when unknown, or internal
        without a rule naming it literally)."""
        try:
            async with asyncio.timeout(self.limits.connect_timeout_s):
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, port, type=socket.SOCK_STREAM
                )
        except (OSError, TimeoutError) as exc:
            message = f"cannot resolve {host!r}: {exc}"
            raise Refusal(502, "egress_unresolved", message, rule.name, "unresolved") from None
        for info in infos:
            address = info[4][0]
            if is_internal(ipaddress.ip_address(address.split("%")[0])) and not rule.names_internal:
                message = (
                    f"{host!r} resolves to the internal address {address}; only a rule naming "
                    "it literally allows that"
                )
                raise Refusal(
                    403, "egress_internal_address", message, rule.name, "internal_address"
                )
        return infos[0][4][0]

    async def _exchange(self, state, request, reader, writer, up_reader, up_writer):
        budget = _Budget(state)
        if request.method == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
            await asyncio.gather(
                self._copy(reader, up_writer, budget, "sent"),
                self._copy(up_reader, writer, budget, "received"),
            )
        else:
            length = content_length(request.headers)
            lines = [f"{request.method} {request.target} HTTP/1.1", f"Host: {authority(request)}"]
            lines += [f"{k}: {v}" for k, v in request.headers if k.lower() not in HOP_BY_HOP]
            lines.append("Connection: close")
            head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
            budget.count("sent", len(head))
            up_writer.write(head)
            await up_writer.drain()
            await asyncio.gather(
                self._copy(reader, up_writer, budget, "sent", length, eof=False),
                self._copy(up_reader, writer, budget, "received"),
            )
        return budget.sent, budget.received

    async def _copy(self, src, dst, budget: _Budget, direction: str, limit=None, eof=True):
        """Copy `src` → `dst` until EOF (or `limit` bytes); stops when the session's byte budget
        is spent or neither direction moved a byte for idle_timeout_s. With `eof`, half-closes
        `dst` at the end."""
        left = limit
        try:
            while left is None or left > 0:
                want = CHUNK_BYTES if left is None else min(CHUNK_BYTES, left)
                try:
                    async with asyncio.timeout(self.limits.idle_timeout_s):
                        data = await src.read(min(want, max(budget.left, 1)))
                except TimeoutError:
                    if time.monotonic() - budget.active_at < self.limits.idle_timeout_s:
                        continue  # the other direction is busy
                    raise
                if not data or not budget.count(direction, len(data)):
                    break
                dst.write(data)
                await dst.drain()
                if left is not None:
                    left -= len(data)
            if eof and dst.can_write_eof():
                dst.write_eof()
        except (ConnectionError, TimeoutError, OSError):
            dst.close()

    async def _closed(self, state, request, verdict, sent: int, received: int) -> None:
        metrics.EGRESS_BYTES.labels("sent").inc(sent)
        metrics.EGRESS_BYTES.labels("received").inc(received)
        record = _record(state, "closed", request, verdict, sent, received)
        try:
            await self.audit.append(record)
        except Exception as exc:
            log.error("egress audit write failed (closed entry)", extra={"error": repr(exc)})

    async def _refuse(self, state, writer, request, refusal: Refusal) -> None:
        """Answer `refusal`, count and audit it, and append it to the session's safety events
        (rule `egress_<reason>`: a malformed or slow head is hostile input too)."""
        verdict = EgressVerdict("deny", refusal.rule, refusal.reason)
        state.counts["deny"] += 1
        metrics.EGRESS_REQUESTS.labels("deny", verdict.reason).inc()
        event = {
            "kind": "egress",
            "verdict": "deny",
            "rule": f"egress_{verdict.reason.removeprefix('egress_')}",
            "reason": verdict.reason,
        }
        if request is not None:
            event["request"] = f"{request.method} {request.host}:{request.port}{request.path}"[
                :2000
            ]
        state.on_denial(event)
        record = _record(state, "decision", request or Request("", "", 0, "", "", ()), verdict)
        try:
            await self.audit.append(record)
        except Exception as exc:
            log.error("egress audit write failed (denial)", extra={"error": repr(exc)})
        await send_error(writer, refusal)


class _Budget:
    def __init__(self, state: EgressState) -> None:
        self.state, self.sent, self.received = state, 0, 0
        self.active_at = time.monotonic()

    @property
    def left(self) -> int:
        return self.state.bytes_left

    def count(self, direction: str, n: int) -> bool:
        """Charge `n` bytes; False (and nothing charged) when that would pass the budget."""
        if n > self.state.bytes_left:
            self.state.bytes_used = self.state.policy.max_bytes
            return False
        self.state.bytes_used += n
        self.active_at = time.monotonic()
        setattr(self, direction, getattr(self, direction) + n)
        return True


def _record(state, phase, request, verdict, sent=0, received=0) -> EgressRecord:
    return EgressRecord(
        state.session_id,
        phase,
        request.method,
        request.host,
        request.port,
        request.path,
        verdict.verdict,
        verdict.rule,
        verdict.reason,
        sent,
        received,
        time.time(),
    )


async def _lingering_close(reader, writer, linger_s: float = 1.0) -> None:
    """Half-close, discard what the client still sends (at most LINGER_BYTES, `linger_s`
    seconds), then close: closing a socket with unread input sends RST, which would destroy an
    answer (a 431, a 408) still on its way to the client."""
    try:
        if not writer.is_closing() and writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(linger_s):
            discarded = 0
            while discarded < LINGER_BYTES and (data := await reader.read(CHUNK_BYTES)):
                discarded += len(data)
    except (ConnectionError, OSError, TimeoutError):
        pass
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except (ConnectionError, OSError, TimeoutError):
        pass
