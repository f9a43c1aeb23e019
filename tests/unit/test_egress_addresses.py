"""Internal means "not global" (services/sandbox/egress/addresses.py): every special-purpose block,
the IPv4 address inside IPv4-mapped, NAT64 and 6to4 forms, and 0.0.0.0 however it is spelled;
and a rule reaches such an address only by naming it literally, in one spelling. Offline: nothing
here opens a socket (the proxy's refusals on a real resolver: test_sandbox_egress_addresses.py)."""

from __future__ import annotations

import pytest

from services.sandbox.egress.addresses import (
    NotAnAddress,
    embedded_ipv4,
    is_internal,
    literal_address,
)
from services.sandbox.egress.rules import EgressPolicy

INTERNAL = [
    "100.64.0.1",  # shared address space (carrier-grade NAT), 100.64.0.0/10
    "100.127.255.254",
    "192.0.0.1",  # IETF protocol assignments, 192.0.0.0/24
    "192.0.0.9",  # PCP anycast: Python calls it global; the whole /24 is internal here
    "192.0.0.170",
    "198.18.0.1",  # benchmarking, 198.18.0.0/15
    "198.19.255.255",
    "240.0.0.1",  # reserved, 240.0.0.0/4
    "255.255.255.255",
    "224.0.0.1",  # multicast
    "0.0.0.0",
    "0.1.2.3",
    "127.0.0.1",
    "10.0.0.1",
    "172.16.0.1",
    "192.168.1.1",
    "169.254.169.254",  # cloud metadata
    "192.0.2.1",  # documentation
    "::1",
    "::",
    "fe80::1",
    "fd00::1",
    "2001:db8::1",
    "::ffff:127.0.0.1",  # IPv4-mapped
    "::ffff:100.64.0.1",
    "::ffff:169.254.169.254",
    "64:ff9b::7f00:1",  # NAT64 (RFC 6052) of 127.0.0.1
    "64:ff9b::6440:1",  # NAT64 of 100.64.0.1
    "64:ff9b::a9fe:a9fe",  # NAT64 of 169.254.169.254
    "2002:7f00:1::1",  # 6to4 of 127.0.0.1
    "::7f00:1",  # IPv4-compatible (deprecated, reserved)
    "ff02::1",
]
GLOBAL = ["8.8.8.8", "151.101.0.223", "2606:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808"]


@pytest.mark.parametrize("address", INTERNAL)
def test_every_address_that_is_not_global_is_internal(address):
    assert is_internal(address)


@pytest.mark.parametrize("address", GLOBAL)
def test_global_addresses_and_the_global_ipv4_inside_mapped_forms_are_not(address):
    assert not is_internal(address)


def test_the_ipv4_inside_an_ipv6_form_is_what_decides():
    assert str(embedded_ipv4(literal_address("64:ff9b::6440:1"))) == "100.64.0.1"
    assert str(embedded_ipv4(literal_address("::ffff:198.18.0.1"))) == "198.18.0.1"
    assert str(embedded_ipv4(literal_address("2002:c000:0201::"))) == "192.0.2.1"
    assert str(embedded_ipv4(literal_address("2001:db8::1"))) == "2001:db8::1"


@pytest.mark.parametrize(
    "spelling",
    ["0", "00", "000", "0x0", "0X00000000", "0.0", "0.0.0", "00.00.00.00", "0x0.0x0.0x0.0x0"],
)
def test_zero_address_in_decimal_octal_and_hex_is_internal(spelling):
    assert str(literal_address(spelling)) == "0.0.0.0"
    assert is_internal(spelling)


def test_numeric_spellings_of_other_addresses_and_what_is_a_name():
    assert str(literal_address("2130706433")) == "127.0.0.1"  # decimal
    assert str(literal_address("0177.0.0.1")) == "127.0.0.1"  # octal
    assert str(literal_address("0x7f.1")) == "127.0.0.1"  # hex, shortened
    assert str(literal_address("1681915905")) == "100.64.0.1"
    assert literal_address("example.org") is None and literal_address("0x1.example") is None
    for numeric_but_no_address in ("0x100.1", "1.2.3.4.5", "08", "4294967296"):
        with pytest.raises(NotAnAddress):
            literal_address(numeric_but_no_address)
    with pytest.raises(ValueError, match="a name"):
        is_internal("example.org")


def test_a_rule_spells_an_address_one_way_and_a_wildcard_never_matches_one():
    with pytest.raises(ValueError, match="as 127.0.0.1"):
        EgressPolicy.parse("p", {"rules": [{"name": "r", "host": "0x7f.1", "ports": [80]}]})
    with pytest.raises(ValueError, match="as 0.0.0.0"):
        EgressPolicy.parse("p", {"rules": [{"name": "r", "host": "0", "ports": [80]}]})
    with pytest.raises(ValueError, match="no address"):
        EgressPolicy.parse("p", {"rules": [{"name": "r", "host": "1.2.3.4.5", "ports": [80]}]})
    policy = EgressPolicy.parse(
        "p",
        {
            "rules": [
                {"name": "cgnat", "host": "100.64.0.1", "ports": [80]},
                {"name": "mapped", "host": "[::FFFF:127.0.0.1]", "ports": [80]},
                {"name": "numeric_suffix", "host": "*.0.0.1", "ports": [80]},
                {"name": "public", "host": "mirror.example.org", "ports": [80]},
            ]
        },
    )
    assert policy.rule("cgnat").names_internal and policy.rule("mapped").names_internal
    assert not policy.rule("public").names_internal
    assert policy.evaluate("GET", "::ffff:7f00:1", 80, "/").rule == "mapped"
    assert policy.evaluate("GET", "127.0.0.1", 80, "/").rule is None  # not via "*.0.0.1"
    assert policy.evaluate("GET", "a.0.0.1", 80, "/").rule == "numeric_suffix"
