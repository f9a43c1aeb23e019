"""HTTP/1.x request heads as the egress proxy (proxy.py) reads them, and its refusals.

`parse_head` takes the bytes up to and including the blank line and returns a `Request`: the
method, the target host (lower case, without a trailing dot) and port, the percent-decoded path
the rules check ("" for CONNECT) and the origin-form target sent upstream. Anything malformed or
ambiguous is a `Refusal` (400; 411 for a chunked request body): a request line that is not
`METHOD target HTTP/1.x`, an origin-form or https:// target, credentials in the URL, a header
line without a colon (obs-fold included), conflicting Content-Lengths, a path with `.` or `..`
segments (also percent-encoded or with backslashes, which some servers fold to `/`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "proxy-authenticate",
    "te",
    "trailer",
    "upgrade",
    "host",
}
_REASONS = {
    400: "Bad Request",
    403: "Forbidden",
    408: "Request Timeout",
    411: "Length Required",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
}


class Refusal(Exception):
    """A request answered with `status` and a JSON error (`code`, `message`, `rule`); audited
    as a deny with `reason` (default: the code)."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        rule: str | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.rule = status, code, message, rule
        self.reason = reason or code


@dataclass(frozen=True)
class Request:
    method: str
    host: str
    port: int
    path: str  # decoded path for the rules ("" for CONNECT)
    target: str  # origin-form target sent upstream (path?query); "" for CONNECT
    headers: tuple[tuple[str, str], ...]


def parse_head(head: bytes) -> Request:
    """Parse a request head (bytes up to and including the blank line); Refusal 400 on anything
    malformed, 411 for a chunked request body."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        raise Refusal(400, "bad_request", "undecodable request head") from None
    lines = text[:-4].split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[2].startswith("HTTP/1."):
        raise Refusal(400, "bad_request", f"bad request line {lines[0][:200]!r}")
    method, target, _ = parts
    method = method.upper()
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or any(c in name for c in " \t"):
            raise Refusal(400, "bad_request", f"bad header line {line[:200]!r}")
        headers.append((name, value.strip()))
    if any(k.lower() == "transfer-encoding" for k, _ in headers):
        raise Refusal(
            411, "chunked_body", "chunked request bodies are not forwarded; send a Content-Length"
        )
    content_length(headers)
    if method == "CONNECT":
        host, port = _split_authority(target, None)
        return Request(method, host, port, "", "", tuple(headers))
    if not target.lower().startswith("http://"):
        raise Refusal(
            400,
            "bad_request",
            "the proxy takes absolute http:// targets (and CONNECT "
            f"for https); got {target[:200]!r}",
        )
    url = urlsplit(target)
    if url.username is not None or url.password is not None:
        raise Refusal(400, "bad_request", "credentials in the target URL are not forwarded")
    host, port = _split_authority(url.netloc, 80)
    path = url.path or "/"
    decoded = unquote(path)
    segments = decoded.replace("\\", "/").split("/")
    if any(s in (".", "..") for s in segments) or "\x00" in decoded:
        raise Refusal(400, "bad_path", f"path {path[:200]!r} has '.' or '..' segments")
    origin = path + (f"?{url.query}" if url.query else "")
    return Request(method, host, port, decoded, origin, tuple(headers))


def _split_authority(authority: str, default_port: int | None) -> tuple[str, int]:
    host, port_text = authority, ""
    if authority.startswith("["):
        end = authority.find("]")
        host, rest = authority[1:end], authority[end + 1 :]
        if end < 0 or (rest and not rest.startswith(":")):
            raise Refusal(400, "bad_request", f"bad authority {authority[:200]!r}")
        port_text = rest[1:]
    elif ":" in authority:
        host, _, port_text = authority.rpartition(":")
    if port_text == "" and default_port is not None:
        port = default_port
    elif port_text.isdigit() and 0 < int(port_text) < 65536:
        port = int(port_text)
    else:
        raise Refusal(400, "bad_request", f"bad or missing port in {authority[:200]!r}")
    if not host or any(c in host for c in "/@ \t?#%"):
        raise Refusal(400, "bad_request", f"bad host in {authority[:200]!r}")
    return host.lower().rstrip("."), port


def content_length(headers) -> int:
    values = {v for k, v in headers if k.lower() == "content-length"}
    if not values:
        return 0
    if len(values) > 1 or not next(iter(values)).isdigit():
        raise Refusal(400, "bad_request", f"bad Content-Length {sorted(values)[:3]}")
    return int(next(iter(values)))


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
