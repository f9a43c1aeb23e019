"""The whole stack as local processes, without Docker (`Stack`: what `shellrl up`, `run`, `eval`
and the end-to-end tests start; the commands are cli/commands/up.py and down.py).

A small launcher on `subprocess` (not honcho/supervisor): we need start-up ordered by each
service's `/readyz`, per-process log files, a pid file for `shellrl down`, and children that
die with the launcher (PR_SET_PDEATHSIG) — honcho has no readiness ordering and supervisor
would add a daemon with its own config format for what is ~200 lines here.

Order: redis-server (AOF in <state>/redis, its own port, never the shared 6379) → engine →
sandbox → verifier → rollout → learner. Shutdown runs in reverse: SIGTERM, a grace period, then
SIGKILL of the process group; Redis last, which rewrites nothing and fsyncs its AOF on SIGTERM.

Auth: every service requires the stack's token (`StackConfig.api_token`, fresh per stack), handed
over as `SHELLRL_API_TOKEN_FILE` = <state>/api_token (mode 0600, never in a command line or an
environment); the CLI reads it from there (`cli.stack_config.api_headers`). Token settings of the
launcher's own environment are not passed on.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cli.polling import poll_until
from cli.stack_config import StackConfig, device_env, port_is_free
from cli.stack_failure import ServiceExited, StackError, last_error_line
from shellrl.service.main import wait_until_ready

_TOKEN_SETTINGS = ("SHELLRL_API_TOKEN", "SHELLRL_API_TOKEN_FILE", "SHELLRL_AUTH_DISABLED")

_PR_SET_PDEATHSIG = 1


def answers_ping(port: int) -> bool:
    """Whether a Redis on 127.0.0.1:`port` answers PING with +PONG now (0.3 s at most; False while
    it loads its AOF, answering -LOADING, or before it listens)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.3) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def die_with_parent() -> None:
    """preexec_fn of a child process: a session of its own, SIGTERM when its parent thread exits."""
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    url: str | None
    pump: threading.Thread | None = None  # copies its output into log_path


class Stack:
    """Starts and stops the processes of one stack. Use as a context manager."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.procs: list[Proc] = []
        self.log_dir = config.state_dir / "logs"
        self.pid_file = config.state_dir / "stack.json"

    # --- start ---------------------------------------------------------------------------
    def start(self) -> Stack:
        cfg = self.config
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)

        def busy() -> list[str]:
            return [
                f"{n}:{p}"
                for n, p in cfg.ports.items()
                if n in ("redis", *cfg.services) and not port_is_free(p)
            ]

        # a stack that was just stopped may still hold its ports
        if not poll_until(lambda: not busy(), timeout_s=20, interval_s=0.5):
            raise StackError(
                f"ports in use: {', '.join(busy())} (another stack running? try `shellrl down`, "
                "or run this one beside it with --port-offset N and its own --state-dir)"
            )
        try:
            self._write_token_file()
            self._start_redis()
            for name in cfg.services:
                self._start_service(name)
        except BaseException:
            self.stop()
            raise
        self._write_pid_file()
        return self

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], url: str | None) -> Proc:
        log_path = self.log_dir / f"{name}.log"
        popen = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        proc = Proc(name, popen, log_path, url)
        proc.pump = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        proc.pump.start()
        self.procs.append(proc)
        return proc

    def _pump(self, proc: Proc) -> None:
        prefix = f"{proc.name:>8} | "
        with open(proc.log_path, "ab") as log:
            for line in iter(proc.popen.stdout.readline, b""):
                log.write(line)
                log.flush()
                if self.config.echo_logs:
                    sys.stdout.write(prefix + line.decode(errors="replace"))
                    sys.stdout.flush()

    def _start_redis(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise StackError(
                "redis-server not found: apt-get install redis-server (make run does this)"
            )
        data = (self.config.state_dir / "redis").resolve()
        data.mkdir(parents=True, exist_ok=True)
        port = self.config.ports["redis"]
        proc = self._spawn(
            "redis",
            [
                exe,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(data),
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
                "--daemonize",
                "no",
            ],
            dict(os.environ),
            None,
        )

        def answers() -> bool:
            if proc.popen.poll() is not None:
                raise StackError(f"redis-server exited; see {proc.log_path}")
            return answers_ping(port)

        if not poll_until(answers, timeout_s=20, interval_s=0.1):
            raise StackError("redis-server did not answer PING within 20 s")

    def _write_token_file(self) -> None:
        """<state>/api_token holding the stack's token, readable by this user only."""
        path = self.config.api_token_file
        path.unlink(missing_ok=True)  # a file of another stack may have other permissions
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.config.api_token + "\n")

    def _start_service(self, name: str) -> None:
        cfg = self.config
        env = {
            **{k: v for k, v in os.environ.items() if k.upper() not in _TOKEN_SETTINGS},
            "PYTHONUNBUFFERED": "1",
            **cfg.common_env(),
            **device_env(cfg.device, name, cfg.gpu_memory, layout=cfg.gpu_layout),
            **cfg.service_env.get(name, {}),
            "SHELLRL_PORT": str(cfg.ports[name]),
            "SHELLRL_HOST": "127.0.0.1",
            "SHELLRL_API_TOKEN_FILE": str(cfg.api_token_file.resolve()),
        }
        proc = self._spawn(name, [sys.executable, "-m", f"services.{name}"], env, cfg.url(name))
        self.wait_ready(proc, cfg.ready_timeout_s)

    def wait_ready(self, proc: Proc, timeout_s: float) -> None:
        try:
            wait_until_ready(proc.url, timeout_s, process=proc.popen, what=proc.name, poll_s=0.25)
        except RuntimeError as exc:
            if proc.popen.poll() is not None and proc.pump is not None:
                proc.pump.join(5.0)  # the log's last lines are still in the pipe
            cause = last_error_line(proc.log_path)
            last = f" (last error: {cause})" if cause else ""
            raise StackError(f"{exc}; see {proc.log_path}{last}") from None

    def raise_if_exited(self) -> None:
        """Raise ServiceExited naming the first service (or redis) whose process has exited since
        it started, with its exit status, failure class (cli/stack_failure.py: oom, crash,
        killed (SIGKILL) ...), log file and the log's last error line (e.g. a learner killed by
        CUDA OOM); return quietly while all of them run."""
        for proc in self.procs:
            status = proc.popen.poll()
            if status is None:
                continue
            if proc.pump is not None:
                proc.pump.join(5.0)  # the log's last lines are still in the pipe
            raise ServiceExited(proc.name, status, proc.log_path, last_error_line(proc.log_path))

    def _write_pid_file(self) -> None:
        self.pid_file.write_text(
            json.dumps(
                {
                    "launcher_pid": os.getpid(),
                    "processes": {p.name: p.popen.pid for p in self.procs},
                    "ports": self.config.ports,
                    "urls": {p.name: p.url for p in self.procs if p.url},
                    "logs": {p.name: str(p.log_path.resolve()) for p in self.procs},
                    "redis_url": self.config.redis_url,
                    "api_token_file": str(self.config.api_token_file.resolve()),
                    "started_at": time.time(),
                },
                indent=2,
            )
        )

    # --- restart one (fault tests, recovery) ------------------------------------------------
    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.proc(name)
        if p.popen.poll() is None:
            os.killpg(p.popen.pid, sig)
            p.popen.wait()

    def restart(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Stop `name` with `sig` (if it still runs) and start it again, "redis" included (same
        port and AOF directory), in its old place in the stop order."""
        index = [p.name for p in self.procs].index(name)
        self.kill(name, sig)
        self.procs = [p for p in self.procs if p.name != name]
        if name == "redis":
            self._start_redis()
        else:
            self._start_service(name)
        self.procs.insert(index, self.procs.pop())
        self._write_pid_file()

    # --- stop ------------------------------------------------------------------------------
    def stop(self, grace_s: float = 20.0) -> None:
        """Reverse order: SIGTERM, wait up to grace_s, then SIGKILL the process group."""
        for p in reversed(self.procs):
            if p.popen.poll() is None:
                try:
                    os.killpg(p.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    p.popen.wait(grace_s)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(
                    p.popen.pid, signal.SIGKILL
                )  # leftovers of that group (sandboxed commands…)
            except (ProcessLookupError, PermissionError):
                pass
            p.popen.wait()
        self.procs = []
        self.pid_file.unlink(missing_ok=True)
        self.config.api_token_file.unlink(missing_ok=True)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
