"""The learner lock (one learner per stream) against a real Redis: a live holder is refused by
name, a dead one is replaced (at once on this host, after the expiry elsewhere), and a learner
that finds another holder at renewal is told."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

import pytest
import redis

from services.learner.learner_lock import LearnerLock, LearnerLockHeld
from shellrl.streams.keys import LEARNER_LOCK_KEY
from tests.helpers.owned_processes import run_owned


@pytest.fixture
def client(redis_server):
    c = redis.Redis.from_url(redis_server.url)
    yield c
    c.close()


def lock(client, name: str, ttl_s: float = 1.0) -> LearnerLock:
    return LearnerLock(client, name=name, port=8103, ttl_s=ttl_s, poll_s=0.05)


def dead_pid() -> int:
    done = run_owned(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, timeout_s=60
    )
    return int(done.stdout)


def test_a_live_holder_is_refused_by_name_within_one_renewal(client):
    first = lock(client, "learner-a")
    first.acquire()
    first.start_renewing(on_lost=lambda holder: None)
    try:
        start = time.monotonic()
        with pytest.raises(LearnerLockHeld, match=r"learner-a \(pid \d+ on host .*, port 8103"):
            # the holder renews every ttl / 3 = 0.33 s; the contender's own deadline (its ttl + 1 s
            # = 31 s) is where a lock that is never seen renewed would end up refused
            lock(client, "learner-b", ttl_s=30).acquire()
        assert time.monotonic() - start < 10  # refused on seeing a renewal, not at its deadline
    finally:
        first.release()
    assert client.get(LEARNER_LOCK_KEY) is None


def test_the_lock_of_a_dead_learner_on_this_host_is_taken_over_at_once(client):
    stale = {"name": "learner-a", "host": socket.gethostname(), "pid": dead_pid(), "port": 1}
    client.set(LEARNER_LOCK_KEY, json.dumps({**stale, "token": "t", "since": 0}), px=60_000)
    second = lock(client, "learner-b", ttl_s=60)
    start = time.monotonic()
    second.acquire()
    assert time.monotonic() - start < 10  # milliseconds; not the 60 s expiry
    assert json.loads(client.get(LEARNER_LOCK_KEY))["name"] == "learner-b"
    second.release()


def test_a_lock_naming_a_pid_that_another_process_now_has_is_taken_over_at_once(client):
    # a container restarted under the same host name: its pid is the dead holder's again
    reused = {"name": "learner-a", "host": socket.gethostname(), "pid": os.getpid(), "port": 1}
    client.set(LEARNER_LOCK_KEY, json.dumps({**reused, "started": "1", "token": "t"}), px=60_000)
    second = lock(client, "learner-b", ttl_s=60)
    second.acquire()
    assert json.loads(client.get(LEARNER_LOCK_KEY))["name"] == "learner-b"
    second.release()


def test_a_lock_left_by_a_learner_on_another_host_is_taken_once_it_expires(client):
    elsewhere = {"name": "learner-a", "host": "elsewhere", "pid": 1, "port": 1}
    client.set(LEARNER_LOCK_KEY, json.dumps({**elsewhere, "token": "t", "since": 0}), px=800)
    second = lock(client, "learner-b", ttl_s=5)
    second.acquire()
    assert json.loads(client.get(LEARNER_LOCK_KEY))["name"] == "learner-b"
    second.release()


def test_a_learner_whose_lock_another_took_is_told_and_release_leaves_the_others_lock(client):
    first, lost = lock(client, "learner-a"), threading.Event()
    first.acquire()
    client.delete(LEARNER_LOCK_KEY)  # as if it expired during a long Redis outage ...
    second = lock(client, "learner-b", ttl_s=30)
    second.acquire()  # ... and another learner started meanwhile
    first.start_renewing(on_lost=lambda holder: lost.set() if "learner-b" in holder else None)
    assert lost.wait(5)
    first.release()
    assert json.loads(client.get(LEARNER_LOCK_KEY))["name"] == "learner-b"
    second.release()
