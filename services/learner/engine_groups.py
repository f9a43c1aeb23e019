"""The distributed transport's process groups on the learner side (`EngineGroups`, one per
engine), and the address an engine reaches the learner's TCPStore at (`route_address`). The
buckets they broadcast are planned in weight_transport.py; `shellrl.weights.distributed` holds
the group itself.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from urllib.parse import urlparse

from services.learner.weight_transport import is_local
from shellrl.weights import distributed as wdist

_GROUP_NUMBERS = itertools.count(
    1
)  # per process: two WeightSyncs of one process never share a name


def route_address(url: str) -> str:
    """This host's address on the route to the engine at `url` (where the engine can reach the
    learner's TCPStore): 127.0.0.1 for a local engine, else the source address the kernel picks."""
    if is_local(url):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((urlparse(url).hostname, urlparse(url).port or 80))  # no packet is sent
        return probe.getsockname()[0]


class EngineGroups:
    """The distributed transport's process groups, one per engine (a dead engine breaks only its
    own), made on an engine's first push: the learner serves the TCPStore and joins as rank 0
    while the engine joins through `/init_weights_update_group` (rank_offset 1, world 1 + TP).
    A group whose push failed is forgotten: closed once its worker thread is done (torch's
    timeout, the deadline, bounds it), and destroyed on the engine before the next group."""

    def __init__(self, client, *, backend: str, timeout_s: float, master_address: str = "") -> None:
        self.client, self.backend, self.timeout_s, self.master_address = (
            client,
            backend,
            timeout_s,
            master_address,
        )
        self._groups: dict[str, wdist.SenderGroup] = {}
        self._stale: dict[str, str] = {}  # url -> the name of a group the engine may still hold

    async def group(self, url: str, tp_size: int) -> wdist.SenderGroup:
        """The engine's live group, joined now if there is none (bounded by the caller's deadline)."""
        group = self._groups.get(url)
        if group is not None:
            return group
        if url in self._stale:
            try:
                await self.client.destroy_weights_update_group(self._stale.pop(url), urls=[url])
            except Exception:  # noqa: BLE001 (the engine destroys a group whose broadcast failed itself)
                pass
        group = wdist.SenderGroup(
            f"shellrl-{os.getpid()}-{next(_GROUP_NUMBERS)}",
            1 + tp_size,
            self.backend,
            self.timeout_s,
        )
        joined = asyncio.ensure_future(asyncio.to_thread(group.join))
        try:
            await self.client.init_weights_update_group(
                self.master_address or route_address(url),
                group.port,
                1,
                1 + tp_size,
                group_name=group.name,
                backend=self.backend,
                urls=[url],
            )
            await joined
        except BaseException:
            self._close_after(group, joined)
            raise
        self._groups[url] = group
        return group

    async def broadcast(self, url: str, group: wdist.SenderGroup, flat, call) -> None:
        """Broadcast `flat` on a worker thread while `call` (the engine's update request) runs; a
        failure of either forgets the group."""
        sending = asyncio.ensure_future(asyncio.to_thread(group.broadcast, flat))
        try:
            await call
            await sending
        except BaseException:
            self.forget(url, sending)
            raise

    def forget(self, url: str, busy: asyncio.Future | None = None) -> None:
        group = self._groups.pop(url, None)
        if group is not None:
            self._stale[url] = group.name
            self._close_after(group, busy)

    @staticmethod
    def _close_after(group: wdist.SenderGroup, busy: asyncio.Future | None) -> None:
        if busy is None or busy.done():
            group.close()
        else:  # a worker thread still in a collective: close when torch's timeout ended it
            busy.add_done_callback(lambda f: (f.cancelled() or f.exception(), group.close()))

    def close(self) -> None:
        for url in list(self._groups):
            self.forget(url)
