"""The two ways into a session's egress proxy; nothing else in the session leads out.

1. A Unix socket per session, `ctl/egress.sock` in its host directory (root's, group = the
   session uid, mode 0660), bind-mounted read-only at `/run/shellrl/egress.sock` (bubblewrap;
   the unshare layer sees its host path). Tools that speak HTTP over a Unix socket use it
   directly (`curl --unix-socket`); the session's environment names it `SHELLRL_EGRESS_SOCKET`.
2. A loopback TCP listener at 127.0.0.1:`LISTEN_PORT` *inside the session's network namespace*,
   which `HTTP_PROXY`/`HTTPS_PROXY` (and lower case) name, because most tools (pip, curl, git,
   urllib) only speak to a proxy over TCP. The service makes this socket itself: a short-lived
   thread enters the namespace of the session's runner (setns(2), root may in any user namespace
   it created), binds and listens, and exits; the listening socket stays in that namespace and
   its connections arrive in the service's event loop, in the same proxy as the Unix socket's.

Why (2) rather than a relay process inside the sandbox relaying TCP to the Unix socket: nothing
runs in the sandbox that its commands could kill, ptrace, replace or starve (they share its uid
and cgroup); no process in `ps`, no pid of the session's budget; the connection's session is
known by which socket it came through, with no header or token to forge. It needs a network
namespace that lives as long as the runner does: session mode with bubblewrap or unshare. Setup
scripts and exec_mode=per_command (a sandbox per command) have only the Unix socket; the
fallback layer (no namespaces, the host network) gets no egress policies at all.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

from services.sandbox.egress.audit import AuditLog
from services.sandbox.egress.head import Refusal
from services.sandbox.egress.proxy import EgressProxy, EgressState, ProxyLimits

log = logging.getLogger(__name__)
LISTEN_PORT = 3128  # the session's own loopback: every session has its own network namespace
IN_SANDBOX_SOCKET = "/run/shellrl/egress.sock"
SOCKET_NAME = "egress.sock"
MAX_CONNECTIONS = 64  # open proxy connections per session; more get an audited 429 at once
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class DoorError(Exception):
    """A door could not be opened (no network namespace found, setns or bind failed)."""


def egress_doors(settings) -> EgressDoors:
    """The doors and proxy of a sandbox instance from its `SandboxSettings` (`egress_*`,
    `redis_url` of the audit stream)."""
    limits = ProxyLimits(
        settings.egress_header_timeout_s,
        settings.egress_max_header_bytes,
        settings.egress_connect_timeout_s,
        settings.egress_idle_timeout_s,
    )
    return EgressDoors(EgressProxy(limits, AuditLog(settings.redis_url)))


def unavailable_reason(layer: str, doors: EgressDoors | None) -> str | None:
    """Why a session with egress rules cannot be served by this instance (None: it can)."""
    if doors is None:
        return "this instance serves no egress proxy"
    if layer == "fallback":
        return (
            "egress rules need a network namespace of the session's own (bubblewrap or unshare); "
            "this instance runs the fallback layer, which shares the host network"
        )
    return None


def proxy_env(socket_path: str, tcp: bool) -> dict[str, str]:
    """Environment variables a session with egress gets: the socket always, the proxy URLs when
    the loopback listener exists (`tcp`); NO_PROXY is emptied so loopback targets go through it."""
    env = {"SHELLRL_EGRESS_SOCKET": socket_path}
    if tcp:
        url = f"http://127.0.0.1:{LISTEN_PORT}"
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
            env[name] = url
        env["NO_PROXY"] = env["no_proxy"] = ""
    return env


@dataclass
class _Doors:
    state: EgressState
    unix: asyncio.Server | None = None
    tcp: asyncio.Server | None = None
    connections: set[asyncio.Task] = field(default_factory=set)


class EgressDoors:
    """The doors of every session with egress, all served by one `EgressProxy`; the stream
    limit of each connection is the proxy's `max_header_bytes` (a longer head gets 431)."""

    def __init__(self, proxy: EgressProxy) -> None:
        self.proxy = proxy
        self._doors: dict[str, _Doors] = {}

    async def open(self, state: EgressState, socket_path: Path, uid: int) -> None:
        """Start the session's Unix socket door at `socket_path` (connectable by `uid`)."""
        doors = self._doors.setdefault(state.session_id, _Doors(state))
        socket_path.unlink(missing_ok=True)
        doors.unix = await asyncio.start_unix_server(
            lambda r, w: self._serve(doors, r, w),
            sock=_unix_listener(socket_path),
            limit=self.proxy.limits.max_header_bytes,
        )
        os.chown(socket_path, 0, uid)
        os.chmod(socket_path, 0o660)

    async def attach(self, session_id: str, launcher_pid: int) -> None:
        """Open the loopback listener in the network namespace of the sandbox started as
        `launcher_pid` (the runner's launcher); DoorError when it cannot be."""
        doors = self._doors.get(session_id)
        if doors is None:
            return
        await self.detach(session_id)
        sock = await asyncio.to_thread(listen_in_netns, launcher_pid, LISTEN_PORT)
        doors.tcp = await asyncio.start_server(
            lambda r, w: self._serve(doors, r, w),
            sock=sock,
            limit=self.proxy.limits.max_header_bytes,
        )

    async def detach(self, session_id: str) -> None:
        """Close the loopback listener (its namespace goes with the runner)."""
        doors = self._doors.get(session_id)
        if doors is not None and doors.tcp is not None:
            server, doors.tcp = doors.tcp, None
            server.close()

    async def close(self, session_id: str) -> None:
        """Close both doors and every open connection of the session."""
        doors = self._doors.pop(session_id, None)
        if doors is None:
            return
        for server in (doors.unix, doors.tcp):
            if server is not None:
                server.close()
        for task in list(doors.connections):
            task.cancel()
        if doors.connections:
            await asyncio.wait(doors.connections, timeout=2.0)

    def summary(self, session_id: str) -> dict | None:
        doors = self._doors.get(session_id)
        return None if doors is None else doors.state.summary()

    async def _serve(self, doors: _Doors, reader, writer) -> None:
        if len(doors.connections) >= MAX_CONNECTIONS:
            message = f"more than {MAX_CONNECTIONS} open egress connections"
            refusal = Refusal(429, "egress_connections", message, reason="connection_limit")
            await self.proxy.turn_away(doors.state, reader, writer, refusal)
            return
        task = asyncio.current_task()
        doors.connections.add(task)
        try:
            await self.proxy.handle(doors.state, reader, writer)
        finally:
            doors.connections.discard(task)


def _unix_listener(path: Path) -> socket.socket:
    """A listening Unix socket at `path`, bound through /proc/self/fd/<dir> so that a long
    workspace_root never meets the 107-byte limit of a socket address."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    directory = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        sock.bind(f"/proc/self/fd/{directory}/{path.name}")
    except OSError:
        sock.close()
        raise
    finally:
        os.close(directory)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _netns_pid(launcher_pid: int, max_depth: int = 6) -> int:
    """The first process at or below `launcher_pid` (breadth first) in another network namespace
    than this service's."""
    own = os.stat("/proc/self/ns/net")
    level = [launcher_pid]
    for _ in range(max_depth):
        children = []
        for pid in level:
            try:
                ns = os.stat(f"/proc/{pid}/ns/net")
                if (ns.st_dev, ns.st_ino) != (own.st_dev, own.st_ino):
                    return pid
                for task in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{task}/children") as f:
                        children += [int(x) for x in f.read().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
        level = children
    raise DoorError(f"no network namespace of its own below pid {launcher_pid}")


def listen_in_netns(launcher_pid: int, port: int) -> socket.socket:
    """A non-blocking TCP socket listening on 127.0.0.1:`port` in the network namespace of the
    sandbox below `launcher_pid`. The namespace is entered by a fresh thread that then ends, so
    no thread of the service stays in it."""
    ns_fd = os.open(f"/proc/{_netns_pid(launcher_pid)}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    result: dict[str, object] = {}

    def enter_and_listen() -> None:
        try:
            if _libc.setns(ns_fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise DoorError(f"setns into the session's network namespace: {os.strerror(err)}")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(128)
            sock.setblocking(False)
            result["sock"] = sock
        except Exception as exc:  # handed to the caller's thread, which raises it
            result["error"] = exc

    try:
        thread = threading.Thread(target=enter_and_listen, name="egress-netns", daemon=True)
        thread.start()
        thread.join()
    finally:
        os.close(ns_fd)
    if "error" in result:
        raise DoorError(f"loopback egress listener: {result['error']}")
    return result["sock"]
