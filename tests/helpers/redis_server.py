"""A real `redis-server` for tests: free loopback port, AOF (appendfsync everysec) in a temp dir,
stopped by its own pid. Tests never touch the shared Redis on port 6379."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from shellrl.service.ports import free_port
from tests.helpers.owned_processes import popen_owned


class RedisServer:
    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not on PATH (apt-get install redis-server)")
        self.proc = popen_owned(
            [
                exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.directory),
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
                "--daemonize",
                "no",
                "--logfile",
                str(self.directory / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            if self.proc.poll() is not None:
                log = self.directory / "redis.log"
                raise RuntimeError(
                    f"redis-server exited: {log.read_text()[-2000:] if log.exists() else ''}"
                )
            time.sleep(0.05)
        self.stop(signal.SIGKILL)  # alive but not answering: never leave it running
        raise RuntimeError(
            f"redis-server on port {self.port} did not answer PING within {timeout_s}s"
        )

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        """SIGTERM (Redis fsyncs the AOF on shutdown) or SIGKILL; waits for the pid."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()
