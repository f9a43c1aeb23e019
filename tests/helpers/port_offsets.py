"""Port offsets for a second `shellrl up`/`run` stack inside a test (`--port-offset N`).

Two suites on one machine (two fresh-clone CIs, a developer's run beside CI) run the same test at the
same moment: a fixed offset, or the first free one in a fixed order, gave both the same ports
('ports in use: redis:7099, ...' after both had seen them free). Each process draws offsets in its
own random order (seeded by its pid), so two suites meet the same offset with probability ~1/350.

Every shifted port stays below the kernel's ephemeral range (net.ipv4.ip_local_port_range), where
any process's outgoing connection may take a port between our check and the service's bind: with
offsets up to 30000 the engine (30000 + offset) bound in that range, and a fresh-clone CI beside
two others failed with "[Errno 98] ... ('127.0.0.1', 45430): address already in use"
(tests/e2e/test_job_during_evals.py, 2026-12-06). Offsets step by 5: the differences between
default ports that two offsets of the range can bridge (1-3 and 1701-1704) are no multiple of 5,
so no two offsets share a port. A machine whose ephemeral range starts too low to leave 50 such
offsets gets the range above it, as before.
"""

from __future__ import annotations

import os
import random

from cli.stack_config import DEFAULT_PORTS, port_is_free
from shellrl.service.ports import ephemeral_low

STEP = 5
BELOW_EPHEMERAL = range(1000, ephemeral_low() - max(DEFAULT_PORTS.values()), STEP)
OFFSETS = (
    BELOW_EPHEMERAL
    if len(BELOW_EPHEMERAL) >= 50
    else range(1000, 65535 - max(DEFAULT_PORTS.values()), STEP)
)


def free_port_offsets(count: int = 1, services: tuple[str, ...] | None = None) -> list[int]:
    """`count` offsets whose ports (Redis and `services`; every service by default) are free and
    shared with no other returned offset nor with the default stack's ports.

    Raises RuntimeError when fewer than `count` such offsets exist."""
    names = ("redis", *services) if services is not None else tuple(DEFAULT_PORTS)
    taken, offsets = {DEFAULT_PORTS[n] for n in names}, []
    order = list(OFFSETS)
    random.Random(os.getpid()).shuffle(order)
    for offset in order:
        ports = {DEFAULT_PORTS[n] + offset for n in names}
        if ports & taken or not all(port_is_free(p) for p in ports):
            continue
        taken |= ports
        offsets.append(offset)
        if len(offsets) == count:
            return offsets
    raise RuntimeError(f"fewer than {count} port offsets with every port of {names} free")
