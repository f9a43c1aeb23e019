"""Choosing a free loopback port for a service that another process will bind.

A port from bind(0) is an ephemeral one, which any outgoing connection (a service's Redis client,
say) may take between the choice and the server's bind ("address already in use": the e2e stack's
learner lost its port that way). `free_port` draws below the kernel's ephemeral range instead, at
random from the OS (SystemRandom: pytest-randomly reseeds `random` before every test, which would
give every concurrent run with the same seed the same ports), over a range wide enough that two
suites or stacks on one machine rarely draw the same port. A choice is still not a reservation:
a caller that starts many services retries with fresh ports when a bind fails.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_PORTS = random.SystemRandom()
SPAN = 22000  # ports drawn from [ephemeral_low - SPAN, ephemeral_low), at least 1024


def ephemeral_low() -> int:
    """First port of the kernel's ephemeral range (net.ipv4.ip_local_port_range; 32768 when it
    cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on at 127.0.0.1 now, below the ephemeral range; an ephemeral one
    (bind(0)) only when 500 draws below it found none free."""
    low = ephemeral_low()
    for _ in range(500):
        port = _PORTS.randint(max(1024, low - SPAN), low - 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
