"""Hostile request heads against the egress proxy's parser (services/sandbox/egress/head.py):
what h11 would let through and another parser might read as a second request (bare LF, obs-fold,
control characters, doubled framing headers) is refused with 400, and `read_head` refuses at the
first bad byte instead of waiting for a blank line. The proxy around it:
tests/service/test_sandbox_egress_smuggling.py; offline."""

from __future__ import annotations

import asyncio

import pytest

from services.sandbox.egress.head import Refusal, parse_head, read_head

OK = b"GET http://h:8080/ok/f HTTP/1.1\r\nHost: h\r\n"


def _refusal(head: bytes) -> Refusal:
    with pytest.raises(Refusal) as info:
        parse_head(head)
    return info.value


def test_a_bare_lf_carrying_a_second_request_is_refused_not_forwarded():
    """The smuggling case of issue 32: a bare LF inside a header value of an allowed GET carried
    `DELETE /smuggled-lf`, which the upstream executed while the audit showed only the GET."""
    head = OK + b"X-A: 1\nDELETE /smuggled-lf HTTP/1.1\nHost: h\n\nX-B: 2\r\n\r\n"
    refusal = _refusal(head)
    assert (refusal.status, refusal.verdict, refusal.reason) == (
        400,
        "refused",
        "control_character",
    )
    assert "bare LF" in refusal.message


@pytest.mark.parametrize(
    ("name", "head", "reason"),
    [
        ("bare CR in a value", OK + b"X-A: 1\rX-B: 2\r\n\r\n", "control_character"),
        ("bare LF in the request line", b"GET http://h/ HTTP/1.1\nHost: h\r\n\r\n", None),
        ("CR CR LF", OK + b"X-A: 1\r\r\n\r\n", "control_character"),
        ("NUL in a value", OK + b"X-A: a\x00b\r\n\r\n", "control_character"),
        ("DEL in a value", OK + b"X-A: a\x7fb\r\n\r\n", "control_character"),
        ("ESC in a value", OK + b"X-A: \x1b[31m\r\n\r\n", "control_character"),
        ("HTAB before a value", OK + b"Transfer-Encoding:\tchunked\r\n\r\n", "control_character"),
        ("control character in the target", b"GET http://h/\x01 HTTP/1.1\r\nHost: h\r\n\r\n", None),
        ("obs-fold", OK + b"X-A: 1\r\n continued\r\n\r\n", "obs_fold"),
        (
            "obs-fold of Transfer-Encoding",
            OK + b"X-A: 1\r\n Transfer-Encoding: chunked\r\n\r\n",
            None,
        ),
        (
            "two equal Content-Lengths",
            OK + b"Content-Length: 3\r\nContent-Length: 3\r\n\r\n",
            "framing",
        ),
        ("a Content-Length list", OK + b"Content-Length: 3, 3\r\n\r\n", "framing"),
        ("a signed Content-Length", OK + b"Content-Length: +3\r\n\r\n", "framing"),
        (
            "Content-Length with Transfer-Encoding",
            OK + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
            "framing",
        ),
        (
            "Transfer-Encoding twice",
            OK + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n",
            "framing",
        ),
        ("space before the colon", OK + b"Content-Length : 3\r\n\r\n", "malformed"),
        ("no Host in HTTP/1.1", b"GET http://h/ HTTP/1.1\r\n\r\n", "malformed"),
        ("HTTP/2.0 in a request line", b"GET http://h/ HTTP/2.0\r\nHost: h\r\n\r\n", "malformed"),
        ("two spaces in the request line", b"GET  http://h/ HTTP/1.1\r\nHost: h\r\n\r\n", None),
        ("a blank line first", b"\r\nGET http://h/ HTTP/1.1\r\nHost: h\r\n\r\n", "malformed"),
        (
            "a body on CONNECT",
            b"CONNECT h:443 HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\n",
            None,
        ),
        ("a host that is numeric but no address", b"GET http://0x100.1/ HTTP/1.0\r\n\r\n", None),
        ("a zone id in the host", b"GET http://[fe80::1%25lo]/ HTTP/1.0\r\n\r\n", None),
    ],
)
def test_hostile_heads_get_400_and_a_refused_verdict(name, head, reason):
    refusal = _refusal(head)
    assert (refusal.status, refusal.code, refusal.verdict) == (400, "bad_request", "refused"), name
    assert reason is None or refusal.reason == reason, (name, refusal.reason, refusal.message)


def test_ip_literals_reach_the_rules_in_one_spelling():
    spellings = {
        b"0": "0.0.0.0",
        b"00": "0.0.0.0",
        b"0x0": "0.0.0.0",
        b"0x7f.1": "127.0.0.1",
        b"2130706433": "127.0.0.1",
        b"017700000001": "127.0.0.1",
        b"[::FFFF:127.0.0.1]": "::ffff:7f00:1",
    }
    for host, canonical in spellings.items():
        request = parse_head(b"GET http://" + host + b":81/ HTTP/1.0\r\n\r\n")
        assert (request.host, request.port) == (canonical, 81), host
    assert parse_head(b"GET http://Example.ORG./ HTTP/1.0\r\n\r\n").host == "example.org"


async def _read(chunks: list[bytes], eof: bool = True, max_bytes: int = 1000):
    reader = asyncio.StreamReader()
    for chunk in chunks:
        reader.feed_data(chunk)
    if eof:
        reader.feed_eof()
    return await asyncio.wait_for(read_head(reader, max_bytes), 1.0)


async def test_read_head_refuses_at_the_first_bad_byte_without_waiting_for_the_blank_line():
    with pytest.raises(Refusal) as info:
        await _read([b"GET http://h/ HTTP/1.1\r\nX: a\n"], eof=False)
    assert info.value.reason == "control_character"
    # a CR LF split across two reads is one line end, not a bare CR
    head, rest = await _read([b"GET http://h/ HTTP/1.0\r", b"\nX: 1\r\n\r", b"\nbody"])
    assert (head, rest) == (b"GET http://h/ HTTP/1.0\r\nX: 1\r\n\r\n", b"body")
    # the body is not the head: control bytes after the blank line are data
    assert (await _read([b"GET http://h/ HTTP/1.0\r\n\r\n\x00\n\r"]))[1] == b"\x00\n\r"


async def test_read_head_refuses_a_cut_short_or_oversized_head():
    with pytest.raises(Refusal) as info:
        await _read([b"GET http://h/ HTTP/1.0\r\n"])
    assert (info.value.status, info.value.reason) == (400, "incomplete_head")
    with pytest.raises(Refusal) as info:
        await _read([b"GET http://h/ HTTP/1.0\r\nX: " + b"a" * 2000 + b"\r\n\r\n"])
    assert info.value.status == 431
