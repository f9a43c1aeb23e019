"""`shellrl up` / `down` / `status`: the whole stack as local processes, without Docker.

A small launcher on `subprocess` (not honcho/supervisor): we need start-up ordered by each
service's `/readyz`, per-process log files, a pid file for `shellrl down`, and children that
die with the launcher (PR_SET_PDEATHSIG) — honcho has no readiness ordering and supervisor
would add a daemon with its own config format for what is ~200 lines here.

Order: redis-server (AOF in <state>/redis, its own port, never the shared 6379) → engine →
sandbox → verifier → rollout → learner. Shutdown runs in reverse: SIGTERM, a grace period, then
SIGKILL of the process group; Redis last, which rewrites nothing and fsyncs its AOF on SIGTERM.
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
from dataclasses import dataclass, field
from pathlib import Path

from cli.errors import CliError
from shellrl.service.main import wait_until_ready

STATE_DIR = Path(os.environ.get("SHELLRL_STATE_DIR", ".shellrl"))
SERVICE_ORDER = ("engine", "sandbox", "verifier", "rollout", "learner")
DEFAULT_PORTS = {
    "redis": 6399,
    "engine": 30000,
    "sandbox": 8101,
    "verifier": 8102,
    "rollout": 8100,
    "learner": 8103,
}
_PR_SET_PDEATHSIG = 1
DEVICES = ("cpu", "cuda")
GPU_SERVICES = ("engine", "learner")
# --device cuda colocates engine and learner on one GPU (the current one: CUDA_VISIBLE_DEVICES picks
# it). Fraction of that GPU's memory each process's caching allocator may hold: torch's
# `per_process_memory_fraction` (PYTORCH_ALLOC_CONF), so an allocation past it raises CUDA OOM in
# that process and never starves the other. The remaining 10% holds the two CUDA contexts (~0.5 GiB
# each) and what is allocated outside torch's allocator (the CUDA IPC mapping of a weight push).
GPU_MEMORY_FRACTIONS = {"engine": 0.4, "learner": 0.5}


class StackError(CliError, RuntimeError):
    """The stack could not start (a port in use, a service that exited or never got ready); the
    message names the service, its log file and the log's last error line. Exit status 1."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_status=1)


def last_error_line(log_path: Path, tail_bytes: int = 64 * 1024) -> str | None:
    """The last line of a service log that names an error (a JSON log record of level ERROR or
    CRITICAL, with the last line of its exception, or a Python exception line such as
    `OSError: ...`), else the last non-empty line;
    None when the log is empty or missing."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if str(record.get("level", "")).upper() in ("ERROR", "CRITICAL"):
                exc = str(record.get("exc") or "").strip().splitlines()
                return str(record.get("msg") or line) + (f": {exc[-1]}" if exc else "")
        elif (
            ("Error" in line or "Exception" in line)
            and ": " in line
            and not line.startswith("File ")
        ):
            return line
    return lines[-1] if lines else None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def check_device(device: str, gpu_memory: dict[str, float] | None = None) -> None:
    """Raise CliError (one line, exit status 2) unless `device` can run here: 'cpu' always; 'cuda'
    needs a torch that sees a GPU, and the GPU memory fractions (service -> fraction) of the
    colocated services must be in (0, 1] and sum to at most 1. Imports torch for 'cuda' only."""
    if device not in DEVICES:
        raise CliError(f"--device {device}: expected one of {', '.join(DEVICES)}")
    if device == "cpu":
        return
    fractions = gpu_memory or GPU_MEMORY_FRACTIONS
    if not all(0 < f <= 1 for f in fractions.values()) or sum(fractions.values()) > 1:
        shown = ", ".join(f"{name} {f:g}" for name, f in fractions.items())
        raise CliError(
            f"--device cuda: GPU memory fractions ({shown}) must be in (0, 1] and sum "
            "to at most 1 (engine and learner share one GPU)"
        )
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise CliError(
            f"--device cuda: no CUDA GPU visible to torch {torch.__version__} "
            f"({build}); use --device cpu"
        )


def device_env(
    device: str,
    service: str,
    gpu_memory: dict[str, float] | None = None,
    environ: dict[str, str] | None = None,
) -> dict[str, str]:
    """Environment that puts `service` on `device` (see GPU_MEMORY_FRACTIONS). cpu: engine and
    learner on the CPU. cuda: engine (bfloat16) and learner on the current GPU, each capped at its
    fraction of the GPU's memory; the other services see no GPU. A PYTORCH_CUDA_ALLOC_CONF or
    PYTORCH_ALLOC_CONF already in `environ` (default os.environ) keeps its options."""
    if device == "cpu":
        return {"SHELLRL_DEVICE": "cpu"} if service in GPU_SERVICES else {}
    if service not in GPU_SERVICES:
        return {"CUDA_VISIBLE_DEVICES": ""}
    environ = os.environ if environ is None else environ
    fraction = (gpu_memory or GPU_MEMORY_FRACTIONS)[service]
    # torch reads PYTORCH_CUDA_ALLOC_CONF before PYTORCH_ALLOC_CONF: extend the one it will read
    cuda_conf = bool(environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    name = "PYTORCH_CUDA_ALLOC_CONF" if cuda_conf else "PYTORCH_ALLOC_CONF"
    options = [
        o
        for o in environ.get(name, "").split(",")
        if o.strip() and not o.strip().startswith("per_process_memory_fraction")
    ]
    budget = f"per_process_memory_fraction:{fraction:g}"
    env = {"SHELLRL_DEVICE": "cuda", name: ",".join([*options, budget])}
    if service == "engine":
        env["SHELLRL_DTYPE"] = "bfloat16"
    return env


def port_is_free(port: int) -> bool:
    """True when nothing listens on 127.0.0.1:`port`. SO_REUSEADDR as uvicorn and redis-server bind
    with it: connections in TIME_WAIT, which a just-stopped stack leaves for a minute, do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@dataclass
class StackConfig:
    """What `shellrl up` starts. ports: service -> port; env: extra SHELLRL_* for every service;
    device: 'cpu' or 'cuda' for engine and learner (`device_env`), gpu_memory: their GPU memory
    fractions with 'cuda'."""

    state_dir: Path = STATE_DIR
    model_path: str = "smollm2"
    device: str = "cpu"
    gpu_memory: dict[str, float] = field(default_factory=lambda: dict(GPU_MEMORY_FRACTIONS))
    ports: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_PORTS))
    env: dict[str, str] = field(default_factory=dict)
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)
    services: tuple[str, ...] = SERVICE_ORDER
    ready_timeout_s: float = 300.0
    echo_logs: bool = True

    def url(self, service: str) -> str:
        return f"http://127.0.0.1:{self.ports[service]}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.ports['redis']}/0"

    def common_env(self) -> dict[str, str]:
        return {
            "SHELLRL_REDIS_URL": self.redis_url,
            "SHELLRL_ENGINE_URLS": self.url("engine"),
            "SHELLRL_SANDBOX_URL": self.url("sandbox"),
            "SHELLRL_VERIFIER_URL": self.url("verifier"),
            "SHELLRL_ROLLOUT_URL": self.url("rollout"),
            "SHELLRL_LEARNER_URL": self.url("learner"),
            "SHELLRL_MODEL_PATH": self.model_path,
            **self.env,
        }


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
        deadline = time.monotonic() + 20  # a stack that was just stopped may still hold its ports
        while True:
            busy = [
                f"{n}:{p}"
                for n, p in cfg.ports.items()
                if n in ("redis", *cfg.services) and not port_is_free(p)
            ]
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if busy:
            raise StackError(
                f"ports in use: {', '.join(busy)} (another stack running? try `shellrl down`)"
            )
        try:
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
            preexec_fn=_die_with_parent,
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
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise StackError(f"redis-server exited; see {proc.log_path}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.3) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.1)
        raise StackError("redis-server did not answer PING within 20 s")

    def _start_service(self, name: str) -> None:
        cfg = self.config
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            **cfg.common_env(),
            **device_env(cfg.device, name, cfg.gpu_memory),
            **cfg.service_env.get(name, {}),
            "SHELLRL_PORT": str(cfg.ports[name]),
            "SHELLRL_HOST": "127.0.0.1",
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

    def _write_pid_file(self) -> None:
        self.pid_file.write_text(
            json.dumps(
                {
                    "launcher_pid": os.getpid(),
                    "processes": {p.name: p.popen.pid for p in self.procs},
                    "ports": self.config.ports,
                    "urls": {p.name: p.url for p in self.procs if p.url},
                    "redis_url": self.config.redis_url,
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

    def restart(self, name: str) -> None:
        self.kill(name)
        self.procs = [p for p in self.procs if p.name != name]
        self._start_service(name)
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

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def up(config: StackConfig) -> int:
    """Foreground: start everything, print the URLs, wait for Ctrl-C or `shellrl down`."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with Stack(config) as stack:
        print(
            f"shellrl is up ({config.device}): rollout {config.url('rollout')}  "
            f"redis {config.redis_url}  logs {stack.log_dir}/",
            flush=True,
        )
        while not stop.is_set():
            dead = [p.name for p in stack.procs if p.popen.poll() is not None]
            if dead:
                print(f"process exited: {', '.join(dead)}; shutting down", file=sys.stderr)
                return 1
            stop.wait(1.0)
        print("shutting down…", flush=True)
    return 0


def down(state_dir: Path = STATE_DIR, timeout_s: float = 60.0) -> int:
    """Stop the stack a `shellrl up` in another terminal started (SIGTERM to its launcher)."""
    pid_file = state_dir / "stack.json"
    if not pid_file.exists():
        print("no stack running (no pid file)")
        return 0
    info = json.loads(pid_file.read_text())
    pid = info["launcher_pid"]
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        # launcher gone: stop its children ourselves, by the pids it recorded
        for child in info["processes"].values():
            try:
                os.killpg(child, signal.SIGTERM)
            except ProcessLookupError:
                pass
        pid_file.unlink(missing_ok=True)
        return 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and pid_file.exists():
        time.sleep(0.2)
    return 0 if not pid_file.exists() else 1
