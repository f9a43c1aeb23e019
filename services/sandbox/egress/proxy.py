"""The egress proxy: one client connection from a session's door (doors.py) → one request.

Consumes an HTTP/1.x request head (head.py: strict byte checks, then h11; at most
`max_header_bytes`, all of it within `header_timeout_s`: a slow sender gets 408, a huge head 431),
asks the session's `EgressPolicy` (rules.py) and its rate and byte limits, writes the verdict to
the audit log (audit.py), then relays (relay.py):

* `CONNECT host:port` → a TCP tunnel (HTTPS; no TLS interception: the host and port are checked,
  the path and method inside the tunnel cannot be);
* `METHOD http://host[:port]/path` (absolute form) → the request rebuilt by h11 in origin form
  with `Host` set to the target and `Connection: close`, its body (Content-Length only; a chunked
  request body gets 411), the response re-framed by h11, and the connection closes: one request
  per connection, so a second request can never ride on a checked one.

Every connection gets exactly one verdict on the audit stream (`decision` entry): `allow`, `deny`
(a request was read; a rule or a limit refused it) or `refused` (the proxy could not or would not
read one: malformed, ambiguous, too large, too slow, cut short, past the session's open
connections); a refusal is audited before the client gets its `HTTP/1.1 <status>` with a JSON
body `{"error": {"code", "message", "rule"}}` and the connection is closed without a reset
(`_lingering_close`). Host names are resolved here, on the host; an address that is not global
(addresses.py) is reached only for a rule naming it literally, and the proxy connects to the
address it checked (no second lookup to rebind). Guarantees: nothing reaches an upstream without
an allowing rule and an audit entry written first; a session's bytes through the proxy (both
directions) stop at its policy's `max_bytes`.
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
from services.sandbox.egress.addresses import is_internal
from services.sandbox.egress.audit import AuditLog, EgressRecord
from services.sandbox.egress.head import Refusal, Request, parse_head, read_head, send_error
from services.sandbox.egress.relay import READ_BYTES, Budget, exchange, tunnel
from services.sandbox.egress.rules import EgressPolicy, EgressRule, EgressVerdict

log = logging.getLogger(__name__)
LINGER_BYTES = 1 << 20
NO_REQUEST = Request("", "", 0, "", "", ())


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
    evenly, burst = one minute's worth), the bytes it has moved, its verdicts by kind, and
    `on_denial`, called with each deny or refusal as a safety event of the session (the
    verifier's safety signal)."""

    session_id: str
    policy: EgressPolicy
    on_denial: Callable[[dict], None]
    tokens: float = 0.0
    refilled_at: float = field(default_factory=time.monotonic)
    bytes_used: int = 0
    counts: dict[str, int] = field(default_factory=lambda: {"allow": 0, "deny": 0, "refused": 0})

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
        except (ConnectionError, TimeoutError):
            pass
        except Exception:  # a bug must not take the door down
            log.exception("egress proxy connection failed", extra={"session_id": state.session_id})
        finally:
            await _lingering_close(reader, writer)

    async def turn_away(self, state: EgressState, reader, writer, refusal: Refusal) -> None:
        """Refuse a connection without reading it (a door's cap): audited, answered, closed."""
        try:
            await self._refuse(state, writer, None, refusal)
        finally:
            await _lingering_close(reader, writer)

    async def _serve(self, state, reader, writer) -> None:
        request = None
        try:
            head, rest = await self._read_head(reader)
            request = parse_head(head)
            verdict, address = await self._decide(state, request)
        except Refusal as refusal:
            return await self._refuse(state, writer, request, refusal)
        except Exception:  # a bug in reading: still one verdict for the connection
            log.exception("egress request failed", extra={"session_id": state.session_id})
            refusal = Refusal(500, "proxy_error", "the proxy failed on this request")
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
        budget = Budget(state, self.limits.idle_timeout_s)
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
                if request.method == "CONNECT":
                    await tunnel(rest, reader, writer, up_reader, up_writer, budget)
                else:
                    await exchange(request, rest, reader, writer, up_reader, up_writer, budget)
            finally:
                up_writer.close()
        finally:
            await self._closed(state, request, verdict, budget.sent, budget.received)

    async def _read_head(self, reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
        """The request head and the bytes after it; Refusal 408 past header_timeout_s (head.py:
        400 for a bad byte or a cut-short head, 431 past max_header_bytes)."""
        try:
            async with asyncio.timeout(self.limits.header_timeout_s):
                return await read_head(reader, self.limits.max_header_bytes)
        except TimeoutError:
            limit_s = self.limits.header_timeout_s
            raise Refusal(
                408, "header_timeout", f"request head not complete in {limit_s} s"
            ) from None
        except (ConnectionError, OSError) as exc:
            raise Refusal(400, "incomplete_head", f"the connection failed: {exc!r}") from None

    async def _decide(self, state: EgressState, request: Request) -> tuple[EgressVerdict, str]:
        """The allowing verdict and the address to connect to; Refusal (deny) otherwise."""
        verdict = self._verdict(state, request)
        if verdict.verdict != "allow":
            message = {
                "no_rule": f"no egress rule allows {request.method} {request.host}:{request.port}"
                + (f" {request.path}" if request.path else ""),
                "rate_limit": f"more than {state.policy.requests_per_minute} requests per minute",
                "byte_limit": f"the session's {state.policy.max_bytes} egress bytes are used up",
            }[verdict.reason]
            status = 403 if verdict.reason == "no_rule" else 429
            raise Refusal(status, f"egress_{verdict.reason}", message, None, verdict.reason, "deny")
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
        """The address to connect to: `host` looked up once (refused when unknown, or when any
        answer is not global and the rule does not name it literally)."""
        try:
            async with asyncio.timeout(self.limits.connect_timeout_s):
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, port, type=socket.SOCK_STREAM
                )
        except (OSError, TimeoutError) as exc:
            message = f"cannot resolve {host!r}: {exc}"
            raise Refusal(
                502, "egress_unresolved", message, rule.name, "unresolved", "deny"
            ) from None
        for info in infos:
            address = info[4][0]
            if is_internal(ipaddress.ip_address(address.split("%")[0])) and not rule.names_internal:
                message = (
                    f"{host!r} resolves to the internal (not global) address {address}; only a "
                    "rule naming it literally allows that"
                )
                raise Refusal(
                    403, "egress_internal_address", message, rule.name, "internal_address", "deny"
                )
        return infos[0][4][0]

    async def _closed(self, state, request, verdict, sent: int, received: int) -> None:
        metrics.EGRESS_BYTES.labels("sent").inc(sent)
        metrics.EGRESS_BYTES.labels("received").inc(received)
        record = _record(state, "closed", request, verdict, sent, received)
        try:
            await self.audit.append(record)
        except Exception as exc:  # the audit stream away: logged, the connection was served
            log.error("egress audit write failed (closed entry)", extra={"error": repr(exc)})

    async def _refuse(self, state, writer, request, refusal: Refusal) -> None:
        """Count and audit `refusal`, then answer it, and append it to the session's safety
        events (rule `egress_<reason>`: a malformed or slow head is hostile input too)."""
        verdict = EgressVerdict(refusal.verdict, refusal.rule, refusal.reason)
        state.counts[verdict.verdict] += 1
        metrics.EGRESS_REQUESTS.labels(verdict.verdict, verdict.reason).inc()
        event = {
            "kind": "egress",
            "verdict": verdict.verdict,
            "rule": f"egress_{verdict.reason.removeprefix('egress_')}",
            "reason": verdict.reason,
        }
        if request is not None:
            event["request"] = f"{request.method} {request.host}:{request.port}{request.path}"[
                :2000
            ]
        state.on_denial(event)
        try:
            await self.audit.append(_record(state, "decision", request or NO_REQUEST, verdict))
        except Exception as exc:  # the audit stream away: logged, the refusal still answered
            log.error("egress audit write failed (refusal)", extra={"error": repr(exc)})
        await send_error(writer, refusal)


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
    answer (a 429, a 431, a 408) still on its way to the client."""
    try:
        if not writer.is_closing() and writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(linger_s):
            discarded = 0
            while discarded < LINGER_BYTES and (data := await reader.read(READ_BYTES)):
                discarded += len(data)
    except (ConnectionError, OSError, TimeoutError):
        pass
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), 1.0)
    except (ConnectionError, OSError, TimeoutError):
        pass
