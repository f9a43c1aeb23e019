"""One learner per stream: a lock in Redis (`shellrl:learner:lock`) that rank 0 holds while it runs.

Two learners on shellrl:trajectories would split the groups between them (or, both being consumer
"learner-0" by default, read each other's pending entries), train two diverging policies and
publish their versions over each other. So rank 0 takes this lock before anything else, and a
second learner refuses to start, naming the holder.

The value (JSON) names the holder: consumer name, host, pid and the process's start time, HTTP
port, since (unix s), plus a token and the time of its last renewal; it expires `ttl_s` after a
renewal, and a thread renews it every `ttl_s / 3` (a thread: a long step on the event loop never
lets it lapse).

`acquire` when another holds it:
  * holder on this host whose process is gone (a crash; torchrun's restart of the group; a
    container restarted under the same host name, whose pid now belongs to another process
    with another start time): taken over at once;
  * otherwise wait: a renewal (the value changes) shows a live holder -> LearnerLockHeld, naming
    it (within about ttl_s / 3); an expiry shows a dead one (on another host) -> taken.
`release` deletes it only while it is ours. A renewal that finds another holder calls `on_lost`
(the learner then stops: it must not train beside the other).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

import redis
from redis.exceptions import ConnectionError as RedisConnectionError

from services.learner.pids import pid_alive
from shellrl.streams.keys import LEARNER_LOCK_KEY

log = logging.getLogger(__name__)

# KEYS[1] lock; ARGV[1] our token, ARGV[2] new value, ARGV[3] ttl ms. 1 = renewed (or re-taken
# after it expired while nobody else took it, e.g. during a Redis outage), 0 = another holds it.
_RENEW = """
local raw = redis.call('GET', KEYS[1])
if raw and cjson.decode(raw)['token'] ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""
# KEYS[1] lock; ARGV[1] the exact value to replace, ARGV[2] new value, ARGV[3] ttl ms.
_REPLACE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return 1
"""
_RELEASE = """
local raw = redis.call('GET', KEYS[1])
if raw and cjson.decode(raw)['token'] == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LearnerLockHeld(RuntimeError):
    """Another learner holds the lock; the message names it."""


def describe(raw: bytes | str) -> str:
    """A holder's record as a sentence: 'learner-0 (pid 12, host h, port 8103, since ...)'."""
    try:
        h = json.loads(raw)
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(float(h["since"])))
        return f"{h['name']} (pid {h['pid']} on host {h['host']}, port {h['port']}, since {since})"
    except (ValueError, KeyError, TypeError):
        return repr(raw)


class LearnerLock:
    """client: a synchronous Redis client; name: the learner's consumer name; port: its HTTP
    port (both only name it to others); ttl_s: expiry after the last renewal (>= 1)."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        name: str,
        port: int,
        ttl_s: float,
        key: str = LEARNER_LOCK_KEY,
        poll_s: float = 0.2,
    ) -> None:
        if ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1; got {ttl_s}")
        self.client, self.key, self.ttl_s, self.poll_s = client, key, ttl_s, poll_s
        self.host, self.pid, self.token = socket.gethostname(), os.getpid(), uuid.uuid4().hex
        self._record = {"name": name, "host": self.host, "pid": self.pid, "port": port}
        self._record["started"] = _start_time(self.pid)
        self._record.update(token=self.token, since=time.time())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _value(self) -> str:
        return json.dumps({**self._record, "renewed_at": time.time()})

    @property
    def _ttl_ms(self) -> int:
        return int(self.ttl_s * 1000)

    def acquire(self, connect_timeout_s: float = 30.0) -> None:
        """Take the lock (see the module docstring). Raises LearnerLockHeld naming a live holder;
        redis ConnectionError when Redis does not answer within connect_timeout_s."""
        deadline, seen = time.monotonic() + self.ttl_s + 1.0, None
        connect_deadline = time.monotonic() + connect_timeout_s
        while True:
            try:
                if self.client.set(self.key, self._value(), nx=True, px=self._ttl_ms):
                    return
                raw = self.client.get(self.key)
            except RedisConnectionError:
                if time.monotonic() > connect_deadline:
                    raise
                time.sleep(1.0)
                continue
            if raw is None:
                continue  # expired between the two calls
            if self._stale(raw) and self.client.register_script(_REPLACE)(
                keys=[self.key], args=[raw, self._value(), self._ttl_ms]
            ):
                log.warning("took over the lock of a dead learner", extra={"holder": describe(raw)})
                return
            if seen is not None and raw != seen:
                raise LearnerLockHeld(self._refusal(raw))
            seen = seen or raw
            if time.monotonic() > deadline:  # neither renewed nor expired: a clock or Redis oddity
                raise LearnerLockHeld(self._refusal(raw))
            time.sleep(self.poll_s)

    def _stale(self, raw: bytes) -> bool:
        """The holder ran on this host and its process is gone: no such pid, or the pid is now
        another process's (its start time differs)."""
        try:
            holder = json.loads(raw)
            host, pid = holder["host"], int(holder["pid"])
        except (ValueError, KeyError, TypeError):
            return False
        if host != self.host:
            return False
        started = holder.get("started")
        return not pid_alive(pid) or (
            started is not None and _start_time(pid) not in (None, started)
        )

    def _refusal(self, raw: bytes) -> str:
        return (
            f"another learner holds {self.key}: {describe(raw)}. One learner trains from one "
            "stream: stop that one first, or give this one its own Redis."
        )

    def start_renewing(self, on_lost: Callable[[str], None]) -> None:
        """Renew every ttl_s / 3 on a daemon thread until `release`; `on_lost(holder)` once when
        another learner holds it (Redis errors are logged and retried at the next renewal)."""
        renew = self.client.register_script(_RENEW)

        def loop() -> None:
            while not self._stop.wait(self.ttl_s / 3):
                try:
                    if not renew(keys=[self.key], args=[self.token, self._value(), self._ttl_ms]):
                        on_lost(describe(self.client.get(self.key) or b"?"))
                        return
                except redis.RedisError as exc:
                    log.warning("learner lock not renewed", extra={"error": str(exc)})

        self._thread = threading.Thread(target=loop, name="learner-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop renewing and delete the lock if it is still ours (errors are logged)."""
        self._stop.set()
        try:
            self.client.register_script(_RELEASE)(keys=[self.key], args=[self.token])
        except redis.RedisError as exc:
            log.warning("learner lock not released", extra={"error": str(exc)})


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks after boot, /proc/<pid>/stat field 22), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
