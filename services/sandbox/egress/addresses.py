"""Which addresses the egress proxy treats as internal, and how it reads an IP literal.

Internal means "not global": `not ipaddress.ip_address(x).is_global` (the IANA special-purpose
registries as Python's `ipaddress` knows them: loopback, RFC 1918, shared address space
100.64.0.0/10, benchmarking 198.18.0.0/15, 0.0.0.0/8, link-local, unique-local, documentation ...),
decided on the IPv4 address an IPv6 form carries when the kernel or a NAT64 gateway would reach
that IPv4 address: IPv4-mapped `::ffff:a.b.c.d`, NAT64 `64:ff9b::/96` (RFC 6052) and 6to4
`2002::/16`. Also internal, although Python calls parts of them global: all of 192.0.0.0/24 (IETF
protocol assignments), multicast, and reserved blocks (240.0.0.0/4, IPv4-compatible `::a.b.c.d`).

One predicate, `is_internal`, decides for the addresses a name resolves to (proxy.py) and for
literal addresses (rules.py: may a rule reach one; head.py: the request's host). `literal_address`
reads what `inet_aton(3)`, and so `getaddrinfo`, would read as an IPv4 address too: `0`, `00`,
`0x0`, `0x7f.1` and `2130706433` are addresses, not names.
"""

from __future__ import annotations

import ipaddress
import re
import socket

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
ALSO_INTERNAL = (ipaddress.IPv4Network("192.0.0.0/24"),)
_NUMERIC_IPV4 = re.compile(r"(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+))*", re.IGNORECASE)


class NotAnAddress(ValueError):
    """A host made only of numeric labels that is no IPv4 address (`0x100.1`, `1.2.3.4.5`)."""


def literal_address(host: str) -> Address | None:
    """The address `host` spells (IPv6 with or without brackets; IPv4 in any `inet_aton` form),
    None for a name; NotAnAddress for a numeric host no address matches."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        pass
    if not _NUMERIC_IPV4.fullmatch(host):
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        raise NotAnAddress(f"{host!r} is numeric but no IPv4 address") from None


def embedded_ipv4(address: Address) -> Address:
    """The IPv4 address an IPv4-mapped, NAT64 (64:ff9b::/96) or 6to4 address carries; else
    `address` itself."""
    if address.version == 6:
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in NAT64:
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if address.sixtofour is not None:
            return address.sixtofour
    return address


def is_internal(address: Address | str) -> bool:
    """True unless `address` (or the IPv4 address it carries) is globally routable; a string is
    read with `literal_address` (ValueError for a name)."""
    if isinstance(address, str):
        literal = literal_address(address)
        if literal is None:
            raise ValueError(f"{address!r} is a name, not an address")
        address = literal
    address = embedded_ipv4(address)
    return (
        not address.is_global
        or address.is_multicast
        or address.is_reserved
        or any(address in net for net in ALSO_INTERNAL if net.version == address.version)
    )
