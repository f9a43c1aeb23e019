"""Port offsets of the tests' second stacks (tests/helpers/port_offsets.py): never in the
ephemeral range, never sharing a port between two offsets."""

from __future__ import annotations

from cli.stack_config import DEFAULT_PORTS
from shellrl.service.ports import ephemeral_low
from tests.helpers.port_offsets import BELOW_EPHEMERAL, OFFSETS, free_port_offsets


def test_every_shifted_port_is_below_the_ephemeral_range_and_no_two_offsets_share_one():
    below = OFFSETS is BELOW_EPHEMERAL  # False only where the ephemeral range starts very low
    assert len(OFFSETS) >= 300 or not below  # two suites meet the same offset rarely
    owner: dict[int, int] = {}
    for offset in OFFSETS:
        for port in (p + offset for p in DEFAULT_PORTS.values()):
            assert 1024 <= port < (ephemeral_low() if below else 65536), (offset, port)
            assert port not in owner, (offset, owner.get(port), port)
            owner[port] = offset


def test_free_offsets_are_distinct_and_from_the_range():
    offsets = free_port_offsets(3)
    assert len(set(offsets)) == 3 and all(o in OFFSETS for o in offsets)
