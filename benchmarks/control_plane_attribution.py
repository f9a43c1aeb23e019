"""Which process sends which Redis commands, and which Lua script each EVALSHA runs.

`attribute(stack, seconds)` reads Redis's MONITOR stream for `seconds` (one line per command
with the client's address), maps each client port to the stack process that owns the socket
(psutil), and each EVALSHA's SHA1 to the script constant of shellrl/services that hashes to it.
Returns {process role: Counter(command or "evalsha:<module>.<SCRIPT>")}. MONITOR slows Redis
down, so it runs apart from the measured window: it gives shares, never costs.
"""

from __future__ import annotations

import hashlib
import importlib
import pkgutil
import re
import time
from collections import Counter, defaultdict

import psutil
import redis

from benchmarks.control_plane_measure import role
from benchmarks.control_plane_stack import Stack

PACKAGES = ("shellrl.streams", "services.rollout", "services.verifier")
_LINE = re.compile(r'^[\d.]+ \[\d+ [\d.]+:(\d+)\] "([^"]+)"(?: "([^"]+)")?')


def script_names() -> dict[str, str]:
    """SHA1 -> "module.CONSTANT" of every string constant holding a Lua script."""
    out = {}
    for package in PACKAGES:
        pkg = importlib.import_module(package)
        for info in pkgutil.iter_modules(pkg.__path__):
            try:
                module = importlib.import_module(f"{package}.{info.name}")
            except ImportError:
                continue
            for name, value in vars(module).items():
                if isinstance(value, str) and "redis.call" in value:
                    sha = hashlib.sha1(value.encode()).hexdigest()
                    out[sha] = f"{info.name}.{name}"
    return out


def port_owners(stack: Stack) -> dict[int, str]:
    """Local port of every TCP connection to Redis -> the role of the process holding it."""
    owners = {}
    for name, pid in stack.pids().items():
        try:
            for conn in psutil.Process(pid).net_connections(kind="tcp"):
                if conn.raddr and conn.raddr.port == stack.redis.port:
                    owners[conn.laddr.port] = role(name)
        except psutil.Error:
            continue
    return owners


def attribute(stack: Stack, seconds: float) -> dict[str, Counter]:
    scripts = script_names()
    client = redis.Redis.from_url(stack.redis.url)
    lines = []
    try:
        with client.monitor() as monitor:
            end = time.monotonic() + seconds
            conn = monitor.connection
            while time.monotonic() < end:
                lines.append(conn.read_response())
    finally:
        client.close()
    owners = port_owners(stack)
    out: dict[str, Counter] = defaultdict(Counter)
    for raw in lines:
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        m = _LINE.match(text)
        if not m:
            continue
        port, command, first = int(m.group(1)), m.group(2).lower(), m.group(3)
        if command == "evalsha" and first:
            command = f"evalsha:{scripts.get(first, first[:8])}"
        out[owners.get(port, "other")][command] += 1
    return dict(out)
