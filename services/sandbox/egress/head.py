"""HTTP/1.x request heads as the egress proxy (proxy.py) reads them, and its refusals.

`read_head` takes a client's bytes up to and including the blank line (CR LF CR LF) and refuses
as soon as a byte arrives that no well-formed head has. `parse_head` turns the head into a
`Request`: the method, the target host (lower case, without a trailing dot, an IP literal in the
form `ipaddress` prints) and port, the percent-decoded path the rules check ("" for CONNECT) and
the origin-form target sent upstream.

The head is parsed by h11 (a strict HTTP/1.1 parser, fuzzed for years) after checks of its own
bytes for what h11 tolerates and another parser downstream might read differently (request
smuggling): h11 takes a bare LF as a line end, unfolds obs-fold lines, lets control characters
other than NUL, CR and LF into header values, and merges repeated equal Content-Lengths. Refused
with 400 (verdict `refused`): a control character (0x00-0x1f, 0x7f; HTAB, a bare CR and a bare LF
included) anywhere but in the CR LF ending a line, a header line starting with a space (obs-fold),
more than one Content-Length, a Content-Length that is not digits, Transfer-Encoding twice or with
a Content-Length, a Content-Length on CONNECT, anything h11 refuses (an HTTP/1.1 request without
Host among them), an HTTP version other than 1.0 and 1.1, a target that is not absolute `http://`
(or `host:port` for CONNECT), credentials in the URL, a path with `.` or `..` segments (also
percent-encoded, with backslashes, which some servers fold to `/`, or with path parameters,
`..;x`, which Tomcat and Spring drop). Transfer-Encoding alone:
411 (chunked request bodies are not forwarded).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import h11

from services.sandbox.egress.addresses import NotAnAddress, literal_address

READ_BYTES = 64 << 10
HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "proxy-authenticate",
    "te",
    "trailer",
    "upgrade",
    "expect",  # the proxy answers 100-continue itself (relay.py)
    "host",
}
_REASONS = {
    400: "Bad Request",
    403: "Forbidden",
    408: "Request Timeout",
    411: "Length Required",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
}
_CONTROL = re.compile(rb"[\x00-\x1f\x7f]")
_CONTROL_NAMES = {b"\r": "a bare CR", b"\n": "a bare LF", b"\t": "HTAB", b"\x00": "NUL"}


class Refusal(Exception):
    """A request answered with `status` and a JSON error (`code`, `message`, `rule`) and audited
    with `verdict` (`refused`: the proxy could not or would not read a request; `deny`: it read
    one and a rule or a limit said no) and `reason` (default: the code)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        rule: str | None = None,
        reason: str | None = None,
        verdict: str = "refused",
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.rule = status, code, message, rule
        self.reason, self.verdict = reason or code, verdict


@dataclass(frozen=True)
class Request:
    method: str
    host: str
    port: int
    path: str  # decoded path for the rules ("" for CONNECT)
    target: str  # origin-form target sent upstream (path?query); "" for CONNECT
    headers: tuple[tuple[str, str], ...]
    head: bytes = field(default=b"", repr=False, compare=False)  # as received (relay.py)


def _bad(message: str, reason: str = "malformed") -> Refusal:
    return Refusal(400, "bad_request", message, reason=reason)


async def read_head(reader: asyncio.StreamReader, max_bytes: int) -> tuple[bytes, bytes]:
    """The head (through CR LF CR LF) and what came after it in the same reads. Refusal 400 at
    the first forbidden byte or when the connection ends first, 431 past `max_bytes`."""
    buf, checked = bytearray(), 0
    while True:
        end = buf.find(b"\r\n\r\n", max(0, checked - 3))
        stop = end + 4 if end >= 0 else len(buf) - buf.endswith(b"\r")
        check_bytes(bytes(buf[checked:stop]))
        checked = stop
        if end >= 0 and stop <= max_bytes:
            return bytes(buf[:stop]), bytes(buf[stop:])
        if len(buf) > max_bytes:
            raise Refusal(431, "header_too_large", f"request head over {max_bytes} bytes")
        data = await reader.read(READ_BYTES)
        if not data:
            message = "the connection ended before a complete request head"
            raise Refusal(400, "incomplete_head", message)
        buf += data


def check_bytes(data: bytes) -> None:
    """Refusal 400 for a control character in `data` other than a CR LF pair."""
    match = _CONTROL.search(data.replace(b"\r\n", b""))
    if match:
        what = _CONTROL_NAMES.get(match.group(), f"control character {match.group()!r}")
        raise _bad(f"{what} in the request head", "control_character")


def parse_head(head: bytes) -> Request:
    """Parse a request head (bytes up to and including the blank line); Refusal 400 on anything
    malformed or ambiguous, 411 for a chunked request body."""
    check_bytes(head)
    lines = head.removesuffix(b"\r\n\r\n").split(b"\r\n")
    if not lines[0] or lines[0][:1] == b" ":
        raise _bad("the request head does not start with a request line")
    if any(line[:1] == b" " for line in lines[1:]):
        raise _bad("a folded header line (obs-fold)", "obs_fold")
    _check_framing(lines[1:])
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=len(head) + 1)
    try:
        conn.receive_data(head)
        event = conn.next_event()
    except h11.RemoteProtocolError as exc:
        raise _bad(f"malformed request head: {exc}") from None
    if not isinstance(event, h11.Request):
        raise _bad("incomplete request head")
    if event.http_version not in (b"1.0", b"1.1"):
        raise _bad(f"HTTP/{event.http_version.decode()} is not spoken here (1.0 and 1.1 are)")
    method, target = event.method.decode("ascii").upper(), event.target.decode("ascii")
    headers = tuple(
        (k.decode("latin-1"), v.decode("latin-1")) for k, v in event.headers.raw_items()
    )
    if method == "CONNECT":
        if content_length(headers):
            raise _bad("CONNECT carries no body", "framing")
        host, port = _split_authority(target, None)
        return Request(method, host, port, "", "", headers, head)
    if not target.lower().startswith("http://"):
        raise _bad(
            "the proxy takes absolute http:// targets (and CONNECT "
            f"for https); got {target[:200]!r}"
        )
    url = urlsplit(target)
    if url.username is not None or url.password is not None:
        raise _bad("credentials in the target URL are not forwarded")
    host, port = _split_authority(url.netloc, 80)
    path = url.path or "/"
    decoded = unquote(path)
    # `..;x` is `..` to servers that drop path parameters (Tomcat, Jetty, Spring)
    segments = [s.partition(";")[0] for s in decoded.replace("\\", "/").split("/")]
    if any(s in (".", "..") for s in segments) or "\x00" in decoded:
        raise Refusal(400, "bad_path", f"path {path[:200]!r} has '.' or '..' segments")
    origin = path + (f"?{url.query}" if url.query else "")
    return Request(method, host, port, decoded, origin, headers, head)


def _check_framing(header_lines: list[bytes]) -> None:
    """One way to tell where the body ends, or a Refusal: two parsers that disagree on it let a
    second request ride in the first one's body."""
    fields = [line.partition(b":") for line in header_lines]
    lengths = [value.strip() for name, _, value in fields if name.lower() == b"content-length"]
    codings = sum(name.lower() == b"transfer-encoding" for name, _, _ in fields)
    if len(lengths) > 1 or codings > 1 or (lengths and codings):
        message = f"{len(lengths)} Content-Length and {codings} Transfer-Encoding headers"
        raise _bad(f"ambiguous body framing: {message}", "framing")
    if lengths and not lengths[0].isdigit():
        raise _bad(f"bad Content-Length {lengths[0][:40]!r}", "framing")
    if codings:
        message = "chunked request bodies are not forwarded; send a Content-Length"
        raise Refusal(411, "chunked_body", message)


def _split_authority(authority: str, default_port: int | None) -> tuple[str, int]:
    host, port_text = authority, ""
    if authority.startswith("["):
        end = authority.find("]")
        host, rest = authority[1:end], authority[end + 1 :]
        if end < 0 or (rest and not rest.startswith(":")):
            raise _bad(f"bad authority {authority[:200]!r}")
        port_text = rest[1:]
    elif ":" in authority:
        host, _, port_text = authority.rpartition(":")
    if port_text == "" and default_port is not None:
        port = default_port
    elif port_text.isdigit() and 0 < int(port_text) < 65536:
        port = int(port_text)
    else:
        raise _bad(f"bad or missing port in {authority[:200]!r}")
    host = host.lower().rstrip(".")
    if not host or any(c in host for c in "/@ \t?#%[]"):
        raise _bad(f"bad host in {authority[:200]!r}")
    try:
        address = literal_address(host)
    except NotAnAddress:
        raise _bad(f"bad host in {authority[:200]!r}: numeric, but no address") from None
    return (host if address is None else str(address)), port


def content_length(headers) -> int:
    """The Content-Length of headers parse_head accepted (at most one, digits), else 0."""
    return next((int(v) for k, v in headers if k.lower() == "content-length"), 0)


def authority(request: Request) -> str:
    host = f"[{request.host}]" if ":" in request.host else request.host
    return host if request.port == 80 else f"{host}:{request.port}"


async def send_error(writer: asyncio.StreamWriter, refusal: Refusal) -> None:
    """Write `HTTP/1.1 <status>` with the refusal as a JSON body and `Connection: close`."""
    body = json.dumps(
        {"error": {"code": refusal.code, "message": refusal.message, "rule": refusal.rule}}
    ).encode()
    head = (
        f"HTTP/1.1 {refusal.status} {_REASONS.get(refusal.status, 'Error')}\r\n"
        "Content-Type: application/json\r\nConnection: close\r\n"
        f"X-Shellrl-Egress: {refusal.code}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    try:
        writer.write(head + body)
        await writer.drain()
    except (ConnectionError, OSError):
        pass
