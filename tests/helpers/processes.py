"""Start shellrl services as real subprocesses (`python -m services.<name>`) and stop them by pid;
they die with the pytest that started them (tests/helpers/owned_processes.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from shellrl.service.main import wait_until_ready
from tests.helpers.owned_processes import popen_owned, stop_owned

REPO = Path(__file__).resolve().parents[2]


class ServiceProcess:
    def __init__(
        self,
        name: str,
        port: int,
        env: dict[str, str],
        log_dir: Path,
        args: list[str] | None = None,
    ) -> None:
        self.name, self.port, self.log_path = name, port, Path(log_dir) / f"{name}-{port}.log"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "SHELLRL_PORT": str(port), **env}
        if not {"SHELLRL_API_TOKEN", "SHELLRL_API_TOKEN_FILE"} & set(self.env):
            # services refuse to start without a token; a test of auth gives one
            self.env.setdefault("SHELLRL_AUTH_DISABLED", "true")
        self.args = args or []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_timeout_s: float = 60.0) -> ServiceProcess:
        return start_together([self], ready_timeout_s)[0]

    def spawn(self) -> ServiceProcess:
        """Start the process without waiting for it (`start` = spawn + wait_ready)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = popen_owned(
            [sys.executable, "-m", f"services.{self.name}", *self.args],
            cwd=REPO,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        return self

    def wait_ready(self, timeout_s: float) -> None:
        try:
            wait_until_ready(self.url, timeout_s, process=self.proc, what=self.name, poll_s=0.1)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}:\n{self.tail()}") from None

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, wait, then SIGKILL of the process group we started."""
        if self.proc is None:
            return None
        code = stop_owned(self.proc, timeout_s)
        self._log.close()
        self.proc = None
        return code

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def start_together(procs: list[ServiceProcess], ready_timeout_s: float) -> list[ServiceProcess]:
    """Spawn every service at once, then wait until each is ready, each given `ready_timeout_s`
    (their start-ups are mostly single-threaded imports: on 2 cores two run in the
    time of one). A service whose readiness needs another (the verifier's the sandbox's, the
    gateway's its engines') is ready once that one is. If any is not ready in time, every one of
    them is stopped (none outlives the test) and the error names it."""
    try:
        for proc in procs:
            proc.spawn()
        for proc in procs:
            proc.wait_ready(ready_timeout_s)
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return procs
