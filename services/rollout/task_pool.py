"""The training pool and the order in which its tasks become GRPO groups.

Consumes `shellrl:tasks` (consumer group `rollout`): each training task joins the pool (a Redis
set) and the current epoch's order, atomically with its XACK, so a crash never loses a task and
a re-delivery never adds it twice. Produces task ids in shuffled epochs: every epoch is a fresh
permutation of the pool (seeded by `seed` and the epoch number, reproducible); a task submitted
mid-epoch joins the rest of the current epoch once, at a uniformly random position (epoch 0 is the
tasks as they arrive, shuffled that way). The order lives in Redis (`shellrl:rollout:epoch:order`), so a
restart continues the epoch where it stopped.

A task leaves the order atomically into the taking replica's "taken" list (LMOVE), and leaves
that only when its group was handed off (`done`) or given up (`put_back`: to the head of the
order). A replica killed meanwhile leaves its taken tasks there; `recover` (at its restart, or by
a live replica once its heartbeat stopped: replicas.py) moves them back to the head of the order,
so every task of an epoch runs as often as without the kill. A task taken in an epoch that has
ended since is run once more in the current one (it makes up the run it missed).

With pass-rate steering (`steering`, steering.py), a task whose template the policy has solved
always or never for a while may be passed over for the epoch (it leaves the taken list like a
handed-off one); after a whole pool's worth of pass-overs in a row the next task runs anyway, so
a pool that is all out of band never spins.

Keys: shellrl:rollout:pool (set of task ids), shellrl:rollout:epoch (int),
shellrl:rollout:epoch:order (list of task ids still to run in this epoch),
shellrl:rollout:taken:{replica} (list of task ids taken, not yet handed off; oldest first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.rollout import metrics as m
from services.rollout.steering import Steering
from services.rollout.task_store import STATE_POOLED, TaskStore
from shellrl.contract import ContractError, Task, split_name
from shellrl.streams import GROUP_ROLLOUT, STREAM_TASKS, StreamConsumer, StreamEntry, task_key
from shellrl.streams.keys import EPOCH_KEY, ORDER_KEY, POOL_KEY, taken_key

log = logging.getLogger(__name__)


# KEYS[1] pool, KEYS[2] order, KEYS[3] task hash, KEYS[4] tasks stream; ARGV[1] task id, ARGV[2] group,
# ARGV[3] entry id, ARGV[4] pooled state name, ARGV[5] u in [0, 1): the newcomer's position in the rest
# of the current epoch (uniform, so even the first epoch, filled by arrivals, is shuffled)
_JOIN = """
local added = redis.call('SADD', KEYS[1], ARGV[1])
if added == 1 then
  local n = redis.call('LLEN', KEYS[2])
  local pos = math.floor(tonumber(ARGV[5]) * (n + 1))
  if pos >= n then
    redis.call('RPUSH', KEYS[2], ARGV[1])
  else
    redis.call('LINSERT', KEYS[2], 'BEFORE', redis.call('LINDEX', KEYS[2], pos), ARGV[1])
  end
  if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('HSET', KEYS[3], 'state', ARGV[4]) end
end
redis.call('XACK', KEYS[4], ARGV[2], ARGV[3])
return added
"""

# KEYS[1] order, KEYS[2] epoch; ARGV: the shuffled ids. Starts the next epoch only if the order is empty.
_NEW_EPOCH = """
if redis.call('LLEN', KEYS[1]) > 0 then return -1 end
for i = 1, #ARGV do redis.call('RPUSH', KEYS[1], ARGV[i]) end
return redis.call('INCR', KEYS[2])
"""

# KEYS[1] taken list, KEYS[2] order; ARGV[1] task id. One taken copy back to the order's head.
_PUT_BACK = """
if redis.call('LREM', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[1])
return 1
"""

# KEYS[1] taken list, KEYS[2] order. Every taken task back to the order's head, in taken order.
_RECOVER = """
local n = 0
while redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT') do n = n + 1 end
return n
"""


@dataclass(frozen=True)
class PooledTask:
    task: Task
    epoch: int


class TaskPool:
    """The training pool: `feed()` fills it from the stream, `next_task()` yields tasks in epochs."""

    def __init__(
        self,
        redis: aioredis.Redis,
        store: TaskStore,
        *,
        consumer: str,
        seed: int = 0,
        claim_min_idle_ms: int = 30_000,
        steering: Steering | None = None,
    ) -> None:
        self.redis, self.store, self.seed, self.replica = redis, store, seed, consumer
        self.steering, self._passed_over_in_row = steering, 0
        self.taken = taken_key(consumer)
        self.consumer = StreamConsumer(
            redis,
            STREAM_TASKS,
            GROUP_ROLLOUT,
            consumer,
            block_ms=1000,
            count=256,
            claim_min_idle_ms=claim_min_idle_ms,
        )
        self._join = redis.register_script(_JOIN)
        self._new_epoch = redis.register_script(_NEW_EPOCH)
        self._put_back = redis.register_script(_PUT_BACK)
        self._recover = redis.register_script(_RECOVER)
        self._arrived = asyncio.Event()
        self._rng = random.Random(seed)

    async def feed(self, stop: asyncio.Event | None = None) -> None:
        """Move training tasks from shellrl:tasks into the pool until `stop` (None: until
        cancelled). Redis outages are waited out by `StreamConsumer.take`."""
        stop = stop or asyncio.Event()
        await self.consumer.ensure_group()
        await self.consumer.consume(stop, self._handle, "task pool feeder")

    async def _handle(self, entry: StreamEntry) -> None:
        task = Task()
        try:
            task.ParseFromString(entry.pb)
            if not task.task_id:
                raise ContractError("task_id is empty")
        except Exception as exc:  # any decode failure: a poison entry goes to the dead letters
            await self.consumer.dead_letter(entry, f"not a valid shellrl.v1.Task: {exc}")
            return
        if split_name(task.split) != "train":  # the REST API only streams training tasks
            await self.consumer.ack(entry.entry_id)
            return
        added = await self._join(
            keys=[POOL_KEY, ORDER_KEY, task_key(task.task_id), STREAM_TASKS],
            args=[task.task_id, GROUP_ROLLOUT, entry.entry_id, STATE_POOLED, self._rng.random()],
        )
        if added:
            m.POOL_TASKS.inc()
            self._arrived.set()

    async def size(self) -> int:
        return int(await self.redis.scard(POOL_KEY))

    async def epoch(self) -> int:
        raw = await self.redis.get(EPOCH_KEY)
        return int(raw) if raw is not None else 0

    async def next_task(self, poll_s: float = 1.0) -> PooledTask:
        """The next task of the current epoch, taken by this replica until `done` or `put_back`;
        starts a new shuffled epoch when it is used up; waits while the pool is empty. Tasks whose
        hash vanished, and tasks steering passes over, are skipped."""
        while True:
            raw = await self.redis.lmove(ORDER_KEY, self.taken, "LEFT", "RIGHT")
            if raw is not None:
                try:
                    task = await self.store.get_task(raw.decode())
                    if task is not None:
                        epoch = await self.epoch()
                        if await self._steered_in(task, epoch):
                            return PooledTask(task, epoch)
                        m.TASKS_PASSED_OVER.inc()
                except BaseException:  # cancelled (or Redis away) before the caller has it
                    with contextlib.suppress(RedisError, OSError):
                        await asyncio.shield(self.put_back(raw.decode()))
                    raise
                await self.done(raw.decode())
                continue
            members = sorted(m_.decode() for m_ in await self.redis.smembers(POOL_KEY))
            m.POOL_TASKS.set(len(members))
            if not members:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), poll_s)
                except TimeoutError:
                    pass
                continue
            epoch = await self.epoch() + 1
            random.Random(self.seed * 1_000_003 + epoch).shuffle(members)
            new_epoch = await self._new_epoch(keys=[ORDER_KEY, EPOCH_KEY], args=members)
            if new_epoch != -1:
                m.EPOCH.set(int(new_epoch))
                log.info(
                    "new epoch over the training pool",
                    extra={"epoch": int(new_epoch), "tasks": len(members)},
                )

    async def _steered_in(self, task: Task, epoch: int) -> bool:
        """Steering's verdict; a pool's worth of pass-overs in a row lets the next task run."""
        if self.steering is None:
            return True
        keep = await self.steering.keep(task, epoch)
        if not keep and self._passed_over_in_row + 1 >= max(await self.size(), 1):
            keep = True
        self._passed_over_in_row = 0 if keep else self._passed_over_in_row + 1
        return keep

    async def done(self, task_id: str) -> None:
        """The group of a task this replica took was handed off (or deliberately finished)."""
        await self.redis.lrem(self.taken, 1, task_id)

    async def put_back(self, task_id: str) -> bool:
        """A task this replica took will not run now: back to the head of the order (atomic).
        Returns False when it was not taken by this replica."""
        return bool(await self._put_back(keys=[self.taken, ORDER_KEY], args=[task_id]))

    async def recover(self, replica: str | None = None) -> int:
        """Every task `replica` (default: this one) took and never handed off goes back to the
        head of the order, in the order it was taken; at start-up, or for a dead replica.
        Returns how many."""
        moved = int(await self._recover(keys=[taken_key(replica or self.replica), ORDER_KEY]))
        if moved:
            log.warning(
                "tasks taken but never handed off went back to the epoch order",
                extra={"replica": replica or self.replica, "tasks": moved},
            )
        return moved
