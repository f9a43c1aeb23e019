"""Egress allow-rules (services/sandbox/egress/rules.py), the policy file's `egress` block, the
proxy's request-head parser and its per-session token bucket; offline. Hostile heads:
test_egress_head.py; internal addresses: test_egress_addresses.py."""

from __future__ import annotations

import ipaddress

import pytest

from services.sandbox.egress.addresses import is_internal
from services.sandbox.egress.doors import proxy_env, unavailable_reason
from services.sandbox.egress.head import Refusal, parse_head
from services.sandbox.egress.proxy import EgressState
from services.sandbox.egress.rules import EgressPolicy
from services.sandbox.policy import PolicySet

RULES = {
    "requests_per_minute": 2,
    "max_bytes": 1000,
    "rules": [
        {"name": "mirror", "host": "127.0.0.1", "ports": [8080], "path_prefix": "/simple/"},
        {"name": "pypi", "host": "*.pythonhosted.org", "ports": [443], "methods": ["CONNECT"]},
    ],
}


def _policy() -> EgressPolicy:
    return EgressPolicy.parse("test", RULES)


def test_first_matching_rule_allows_and_nothing_else_does():
    policy = _policy()
    assert policy.evaluate("GET", "127.0.0.1", 8080, "/simple/pip/").rule == "mirror"
    assert policy.evaluate("HEAD", "127.0.0.1", 8080, "/simple/").verdict == "allow"
    for method, host, port, path in [
        ("POST", "127.0.0.1", 8080, "/simple/"),  # method not listed (default GET, HEAD)
        ("GET", "127.0.0.1", 8081, "/simple/"),  # port
        ("GET", "127.0.0.1", 8080, "/admin"),  # path prefix
        ("GET", "127.0.0.2", 8080, "/simple/"),  # host
        ("CONNECT", "127.0.0.1", 8080, ""),  # CONNECT must be listed
        ("CONNECT", "pythonhosted.org", 443, ""),  # the wildcard needs a label before it
        ("GET", "files.pythonhosted.org", 443, "/"),  # only CONNECT listed
    ]:
        verdict = policy.evaluate(method, host, port, path)
        assert (verdict.verdict, verdict.rule, verdict.reason) == ("deny", None, "no_rule")
    assert policy.evaluate("CONNECT", "Files.PythonHosted.org.", 443, "").rule == "pypi"


def test_only_rules_naming_an_internal_address_literally_may_reach_one():
    policy = _policy()
    assert policy.rule("mirror").names_internal and not policy.rule("pypi").names_internal
    for address in ("127.0.0.1", "10.1.2.3", "169.254.169.254", "::1", "::ffff:127.0.0.1"):
        assert is_internal(ipaddress.ip_address(address)), address
    assert not is_internal(ipaddress.ip_address("151.101.0.223"))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"rules": [{"name": "x", "host": "a.org"}]}, "needs name, host and ports"),
        ({"rules": [{"name": "x", "host": "a.org", "ports": [0]}]}, "ports must be"),
        ({"rules": [{"name": "x", "host": "a/b", "ports": [80]}]}, "bad host"),
        ({"rules": [{"name": "x", "host": "*a.org", "ports": [80]}]}, "wildcard host"),
        ({"rules": [{"name": "x", "host": "a.org", "ports": [80], "path_prefix": "p"}]}, "'/'"),
        ({"rules": [], "max_bytes": 0}, "max_bytes must be a positive"),
        ({"rule": []}, "unknown keys"),
    ],
)
def test_bad_egress_blocks_fail_to_load_naming_the_mistake(spec, message):
    with pytest.raises(ValueError, match=message):
        EgressPolicy.parse("policies.yaml: policy 'p'", spec)


def test_policy_file_egress_block_is_inherited_and_excludes_network(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        "policies:\n  default: {rules: []}\n  web:\n    egress:\n      rules:\n"
        "        - {name: r, host: example.org, ports: [80]}\n  web2: {extends: web}\n"
    )
    policies = PolicySet.load(path).policies
    assert policies["default"].egress is None
    assert policies["web2"].egress.rules[0].name == "r"
    path.write_text("policies:\n  x:\n    network: true\n    egress: {rules: []}\n")
    with pytest.raises(ValueError, match="both network: true and egress"):
        PolicySet.load(path)
    assert PolicySet.load().policies["default"].egress is None  # the packaged default: no network


def test_request_heads_parse_to_what_the_rules_check():
    request = parse_head(
        b"GET http://Example.org:8080/a%20b/c?q=1 HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n"
    )
    assert (request.method, request.host, request.port) == ("GET", "example.org", 8080)
    assert (request.path, request.target) == ("/a b/c", "/a%20b/c?q=1")
    assert request.headers == (("Host", "x"), ("Accept", "*/*"))
    connect = parse_head(b"CONNECT [::1]:443 HTTP/1.1\r\nHost: [::1]:443\r\n\r\n")
    assert (connect.host, connect.port, connect.path) == ("::1", 443, "")
    assert parse_head(b"GET http://h/ HTTP/1.0\r\n\r\n").port == 80


@pytest.mark.parametrize(
    ("head", "status", "code"),
    [
        (b"GET /origin-form HTTP/1.1\r\nHost: h\r\n\r\n", 400, "bad_request"),
        (b"GET https://h/ HTTP/1.1\r\nHost: h\r\n\r\n", 400, "bad_request"),
        (b"GET http://h/ok/../admin HTTP/1.1\r\nHost: h\r\n\r\n", 400, "bad_path"),
        (b"GET http://h/ok/%2e%2e/admin HTTP/1.1\r\nHost: h\r\n\r\n", 400, "bad_path"),
        (b"GET http://user:pw@h/ HTTP/1.1\r\nHost: h\r\n\r\n", 400, "bad_request"),
        (b"CONNECT h HTTP/1.1\r\nHost: h\r\n\r\n", 400, "bad_request"),
        (b"CONNECT h:99999 HTTP/1.1\r\nHost: h\r\n\r\n", 400, "bad_request"),
        (b"GET http://h/ HTTP/1.1\r\nHost: h\r\n folded\r\n\r\n", 400, "bad_request"),
        (b"POST http://h/ HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400, None),
        (b"POST http://h/ HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n", 411, None),
        (b"\x16\x03\x01\x00\r\n\r\n", 400, "bad_request"),
    ],
)
def test_malformed_or_ambiguous_heads_are_refused(head, status, code):
    with pytest.raises(Refusal) as info:
        parse_head(head)
    assert info.value.status == status and (code is None or info.value.code == code)


def test_token_bucket_allows_requests_per_minute_then_refuses():
    state = EgressState("s", _policy(), lambda event: None)
    assert [state.take_token() for _ in range(3)] == [True, True, False]
    state.refilled_at -= 30.0  # half a minute later: one more token (2 per minute)
    assert state.take_token() and not state.take_token()
    assert state.summary() == {"allow": 0, "deny": 0, "refused": 0, "bytes": 0, "max_bytes": 1000}


def test_proxy_environment_and_where_egress_is_unavailable():
    env = proxy_env("/run/shellrl/egress.sock", tcp=True)
    assert env["HTTPS_PROXY"] == env["http_proxy"] == "http://127.0.0.1:3128"
    assert env["NO_PROXY"] == "" and env["SHELLRL_EGRESS_SOCKET"] == "/run/shellrl/egress.sock"
    assert proxy_env("/x.sock", tcp=False) == {"SHELLRL_EGRESS_SOCKET": "/x.sock"}
    assert "fallback" in unavailable_reason("fallback", object())
    assert unavailable_reason("bubblewrap", None) is not None
    assert unavailable_reason("unshare", object()) is None
