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

from services.learner.weights.weight_transport import is_local
from shellrl.clients.engine_responses import EngineError
from shellrl.weights import distributed as wdist

DESTROY_TIMEOUT_S = 5.0  # an engine's /destroy_weights_update_group when the learner closes a group

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
    A group the learner closes is destroyed on the engine too (SGLang's
    `/destroy_weights_update_group`, bounded by DESTROY_TIMEOUT_S), so no engine holds a group
    the learner left: a group whose push failed or whose engine was taken out (`forget`; closed
    on the learner once its worker thread is done: torch's timeout, the deadline, bounds it),
    and every group at `aclose` (the learner's shutdown). An engine that did not answer has its
    group destroyed before its next one. Both sides leave through shellrl.process_groups.leave."""

    def __init__(self, client, *, backend: str, timeout_s: float, master_address: str = "") -> None:
        self.client, self.backend, self.timeout_s, self.master_address = (
            client,
            backend,
            timeout_s,
            master_address,
        )
        self._groups: dict[str, wdist.SenderGroup] = {}
        self._stale: dict[str, str] = {}  # url -> the name of a group the engine may still hold
        self._destroying: set[asyncio.Task] = set()  # destroy calls in flight (`_tell`)

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

    def forget(self, url: str, busy: asyncio.Future | None = None, *, tell: bool = True) -> None:
        """Close the learner's side of `url`'s group (once `busy`, a worker thread in a
        collective, is done) and, with `tell` and a running event loop, have the engine destroy
        its side in the background (`_tell`)."""
        group = self._groups.pop(url, None)
        if group is not None:
            self._stale[url] = group.name
            self._close_after(group, busy)
            if tell:
                self._tell(url)

    def _tell(self, url: str) -> None:
        """Destroy the engine's stale group in the background (no event loop: before its next)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        task = loop.create_task(self._destroy_stale(url))
        self._destroying.add(task)
        task.add_done_callback(self._destroying.discard)

    async def _destroy_stale(self, url: str) -> None:
        """/destroy_weights_update_group for `url`'s stale group, bounded; the name is dropped once
        the engine answered (a 400 too: it destroyed the group itself after a failed broadcast)."""
        name = self._stale.get(url)
        if name is None:
            return
        try:
            await asyncio.wait_for(
                self.client.destroy_weights_update_group(name, urls=[url]),
                min(self.timeout_s, DESTROY_TIMEOUT_S),
            )
        except EngineError as exc:
            if exc.status != 400:  # refused (401, 404...), not "no such group": try again later
                return
        except Exception:  # noqa: BLE001 (no answer: destroyed before the engine's next group)
            return
        if self._stale.get(url) == name:
            del self._stale[url]

    async def aclose(self) -> None:
        """Close every group on both sides: the learner's now, each engine's by its
        /destroy_weights_update_group (each call bounded by DESTROY_TIMEOUT_S; never raises)."""
        for url in list(self._groups):
            self.forget(url, tell=False)
        for url in list(self._stale):
            self._tell(url)
        if self._destroying:
            await asyncio.wait(set(self._destroying))

    @staticmethod
    def _close_after(group: wdist.SenderGroup, busy: asyncio.Future | None) -> None:
        if busy is None or busy.done():
            group.close()
        else:  # a worker thread still in a collective: close when torch's timeout ended it
            busy.add_done_callback(lambda f: (f.cancelled() or f.exception(), group.close()))

    def close(self) -> None:
        """The learner's side only (no event loop needed); `aclose` also tells the engines."""
        for url in list(self._groups):
            self.forget(url, tell=False)
