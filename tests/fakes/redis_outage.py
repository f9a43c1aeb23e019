"""RedisOutageStore: the real services.rollout TaskStore, plus a Redis outage at a chosen moment of
a group's life, for tests of the gateway's bookkeeping across a Redis restart.

The first `episode_finished` (a sample just published its trajectory; the group's hand-off comes
next) stops the real redis-server (SIGTERM: its AOF is fsynced) and starts it again on the same
port and AOF directory `outage_s` seconds later, in a thread; that call itself then fails as the
store's calls do while Redis is away. Every other call goes to the real store.
"""

from __future__ import annotations

import asyncio
import threading
import time

from redis.exceptions import ConnectionError as RedisConnectionError

from services.rollout.task_store import TaskStore


class RedisOutageStore(TaskStore):
    def __init__(self, redis, server, outage_s: float) -> None:
        super().__init__(redis)
        self.server, self.outage_s = server, outage_s
        self.restarted = threading.Event()
        self._done = False

    async def episode_finished(self, task_id: str, **kwargs) -> None:
        if self._done:
            return await super().episode_finished(task_id, **kwargs)
        self._done = True
        await asyncio.to_thread(self.server.stop)
        threading.Thread(target=self._start_later, daemon=True).start()
        raise RedisConnectionError("Connection closed by server.")

    def _start_later(self) -> None:
        time.sleep(self.outage_s)
        self.server.start()
        self.restarted.set()
