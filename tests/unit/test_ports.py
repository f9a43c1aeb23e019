"""shellrl.service.ports.free_port: below the kernel's ephemeral range (a bind(0) port may be taken by
any outgoing connection before the service binds it; cli/experiments/runner.py and
benchmarks/gpu_common.py chose ports that way), free when chosen, spread over SPAN ports."""

from __future__ import annotations

import socket
from pathlib import Path

from shellrl.service.ports import SPAN, ephemeral_low, free_port

REPO = Path(__file__).resolve().parents[2]


def test_ports_are_free_and_below_the_ephemeral_range():
    low = ephemeral_low()
    ports = [free_port() for _ in range(200)]
    assert all(max(1024, low - SPAN) <= p < low for p in ports)
    assert len(set(ports)) > 150  # drawn at random, not the first free one
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_no_code_outside_tests_chooses_a_port_with_bind_0():
    """cli/, services/, shellrl/ and benchmarks/ take ports from free_port, never bind(0)."""
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for folder in ("cli", "services", "shellrl", "benchmarks")
        for path in sorted((REPO / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if '.bind(("127.0.0.1", 0))' in line and path.name != "ports.py"
    ]
    assert found == []
