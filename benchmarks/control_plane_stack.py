"""The stack the control-plane benchmark loads: real shared parts, simulated engines and sandboxes.

    redis-server (real, AOF everysec: the test fixture's configuration), and with
                 --stream-shards S, S more holding the training streams (shards.py)
    N FakeLatencyEngines in one process, one port each  ─┐  tests/fakes/fake_latency.py
    one FakeLatencySandbox                               ─┘  (latency from control_plane_profile)
    R rollout gateways   python -m services.rollout   (real: admission, task pool, agent loop)
    1 verifier           python -m services.verifier  (real: checks against the fake sandbox)
    1 learner intake     python -m benchmarks.control_plane_learner (real LearnerWorker intake,
                         FakeStepCompute, FakeWeightSync)

Every process is started with tests/helpers/owned_processes.popen_owned (its own process group,
PDEATHSIG, the reaper): it dies with the harness however the harness ends; `stop()` stops each
by pid (SIGTERM, a grace period, then SIGKILL of its group). `Stack.start` returns once every
service answers /readyz and the tasks are submitted (RuntimeError, everything stopped, when one
does not within its deadline).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.control_plane_profile import build_profile
from services.rollout.prompt import ChatFormat, load_chat_tokenizer
from shellrl.service.main import wait_until_ready
from tests.helpers.owned_processes import popen_owned, stop_owned
from tests.helpers.redis_server import RedisServer, free_port

REPO = Path(__file__).resolve().parents[1]
GROUP_SIZE = 16  # the GPU job's (benchmarks/gpu_job.toml)
MAX_TURNS = 3


@dataclass(frozen=True)
class StackConfig:
    engines: int
    gateways: int = 1
    max_staleness: int = 2
    # the learner keeps pace: an engine finishes ~23 episodes/s, 1.8 groups of 16 a 1.27 s step
    groups_per_step_per_engine: float = 2.0
    step_s: float = 1.27  # the GPU job's median trained learner step
    tasks: int = 64
    verifier_concurrency: int = 64
    learner_cprofile: str | None = None  # cProfile the learner's intake into this file
    trajectories_maxlen: int | None = None  # SHELLRL_TRAJECTORIES_STREAM_MAXLEN of the verifier
    learner_paused: bool = False  # the learner takes nothing until SIGUSR1 (control_plane_drain)
    stream_shards: int = (
        0  # Redis instances holding the training streams (shellrl/streams/shards.py)
    )

    @property
    def groups_per_step(self) -> int:
        return max(1, round(self.engines * self.groups_per_step_per_engine))


def write_profile(directory: Path) -> Path:
    chat = ChatFormat.from_tokenizer(load_chat_tokenizer("tiny"))
    body = build_profile(
        lambda text: chat.tokenizer(text, add_special_tokens=False)["input_ids"],
        chat.end_of_turn_id,
    )
    path = directory / "profile.json"
    path.write_text(json.dumps(body, indent=1))
    return path


def tasks(n: int) -> list[dict]:
    return [
        {
            "task_id": f"cp-{i:04d}",
            "instruction": f"How many lines does numbers.txt have? (variant {i})",
            "setup": "seq 1 5 > numbers.txt",
            "check": [
                {"type": "answer_integer_equals", "expected": 5},
                {"type": "file_exists", "path": "numbers.txt"},
            ],
            "max_turns": MAX_TURNS,
        }
        for i in range(n)
    ]


@dataclass
class Stack:
    config: StackConfig
    directory: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="bench-cp-")))
    redis: RedisServer | None = None
    shard_redis: list[RedisServer] = field(default_factory=list)  # the stream shards
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    gateway_urls: list[str] = field(default_factory=list)
    engine_urls: list[str] = field(default_factory=list)
    sandbox_url: str = ""
    verifier_url: str = ""
    stopped: set[str] = field(default_factory=set)  # by stop_only: not a failure
    _drawn: set[int] = field(default_factory=set)  # ports drawn for this stack's services

    @property
    def learner_stats(self) -> Path:
        return self.directory / "learner-stats.json"

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.directory / f"{name}.log", "wb")  # noqa: SIM115 (kept with the process)
        self.procs[name] = popen_owned(
            [sys.executable, *argv],
            cwd=REPO,
            env={**os.environ, "SHELLRL_AUTH_DISABLED": "true", **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def _free_port(self) -> int:
        """`free_port`, never one this stack drew already: its 64-odd ports are drawn before any
        binds, and from 22,000 ports two of 69 draws coincide about one time in ten (a fake
        engine's 'address already in use' failed a 64-engine point twice running)."""
        while (port := free_port()) in self._drawn:
            pass
        self._drawn.add(port)
        return port

    def start(self, profile: Path) -> Stack:
        c = self.config
        try:
            self.redis = RedisServer(self.directory / "redis").start()
            url = self.redis.url
            for k in range(1, c.stream_shards + 1):
                self.shard_redis.append(RedisServer(self.directory / f"redis-shard-{k}").start())
            shard_urls = ",".join(r.url for r in self.shard_redis)
            ports = [self._free_port() for _ in range(c.engines)]
            self.engine_urls = [f"http://127.0.0.1:{p}" for p in ports]
            ports_arg = ",".join(map(str, ports))
            self._spawn(
                "engines",
                ["-m", "tests.fakes.fake_latency", "engines", "--ports", ports_arg,
                 "--profile", str(profile)],
            )  # fmt: skip
            sandbox = self.sandbox_url = f"http://127.0.0.1:{self._free_port()}"
            self._spawn(
                "sandbox",
                ["-m", "tests.fakes.fake_latency", "sandbox", "--port", sandbox.rsplit(":", 1)[1],
                 "--profile", str(profile)],
            )  # fmt: skip
            common = {
                "SHELLRL_REDIS_URL": url,
                "SHELLRL_SANDBOX_URL": sandbox,
                "SHELLRL_LOG_LEVEL": "WARNING",
                "SHELLRL_SHUTDOWN_GRACE_S": "2",  # the harness stops them: drain briefly
                "SHELLRL_MAX_STALENESS": str(c.max_staleness),
                "SHELLRL_GROUPS_PER_STEP": str(c.groups_per_step),
                "SHELLRL_STREAM_SHARD_URLS": shard_urls,
            }
            verifier = self.verifier_url = f"http://127.0.0.1:{self._free_port()}"
            self._spawn(
                "verifier",
                ["-m", "services.verifier", "--port", verifier.rsplit(":", 1)[1]],
                {
                    **common,
                    "SHELLRL_CONCURRENCY": str(c.verifier_concurrency),
                    **(
                        {"SHELLRL_TRAJECTORIES_STREAM_MAXLEN": str(c.trajectories_maxlen)}
                        if c.trajectories_maxlen
                        else {}
                    ),
                },
            )
            in_flight = max(GROUP_SIZE, c.engines * 64 // c.gateways)  # every engine slot busy
            for i in range(c.gateways):
                port = self._free_port()
                self.gateway_urls.append(f"http://127.0.0.1:{port}")
                self._spawn(
                    f"gateway-{i}",
                    ["-m", "services.rollout", "--port", str(port)],
                    {
                        **common,
                        "SHELLRL_ENGINE_URLS": ",".join(self.engine_urls),
                        "SHELLRL_VERIFIER_URL": verifier,
                        "SHELLRL_MODEL_PATH": "tiny",
                        "SHELLRL_GROUP_SIZE": str(GROUP_SIZE),
                        "SHELLRL_MAX_TURNS": str(MAX_TURNS),
                        "SHELLRL_MAX_EPISODES_IN_FLIGHT": str(in_flight),
                        "SHELLRL_CONSUMER_NAME": f"rollout-{i}",
                    },
                )
            self._spawn(
                "learner",
                ["-m", "benchmarks.control_plane_learner", "--redis-url", url,
                 "--shard-urls", shard_urls,
                 "--engines", ",".join(self.engine_urls), "--stats", str(self.learner_stats),
                 "--groups-per-step", str(c.groups_per_step),
                 "--max-staleness", str(c.max_staleness), "--step-s", str(c.step_s),
                 *(["--cprofile", c.learner_cprofile] if c.learner_cprofile else []),
                 *(["--start-paused"] if c.learner_paused else [])],
            )  # fmt: skip
            for name, target in [
                ("engines", self.engine_urls[0]),
                ("sandbox", sandbox),
                ("verifier", verifier),
                *((f"gateway-{i}", u) for i, u in enumerate(self.gateway_urls)),
            ]:
                wait_until_ready(target, 180, process=self.procs[name], what=name, poll_s=0.1)
            self._check_ports_owned()
            r = httpx.post(f"{self.gateway_urls[0]}/v1/tasks", json=tasks(c.tasks), timeout=60)
            r.raise_for_status()
        except RuntimeError as exc:  # a process that exited: its log says why
            tails = self._exited_logs()
            self.stop()
            raise RuntimeError(f"{exc}\n{tails}") from exc
        except BaseException:
            self.stop()
            raise
        return self

    def _check_ports_owned(self, deadline_s: float = 60.0) -> None:
        """RuntimeError unless every port this stack chose is listened on by the process it was
        chosen for, within deadline_s (the fake engines bind theirs one after another). A ready
        answer alone does not say whose it is: a port another process bound between choice and
        bind answers /readyz while ours dies of EADDRINUSE (a verifier, then the learner's push
        to an engine that is not ours, ended two make bench runs)."""
        wanted = {"engines": self.engine_urls, "sandbox": [self.sandbox_url],
                  "verifier": [self.verifier_url],
                  **{f"gateway-{i}": [u] for i, u in enumerate(self.gateway_urls)}}  # fmt: skip
        deadline = time.monotonic() + deadline_s
        while True:
            stray = {
                name: ports
                for name, urls in wanted.items()
                if (ports := [p for p in _ports(urls) if not _listens(self.procs[name].pid, p)])
            }
            if not stray:
                return
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"ports listened on by another process: {stray}")
            time.sleep(0.1)  # poll period of the condition

    def _exited_logs(self) -> str:
        out = []
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                log = (self.directory / f"{name}.log").read_text(errors="replace")
                out.append(f"--- {name} (exit {proc.returncode}):\n{log[-2000:]}")
        return "\n".join(out)

    def pids(self) -> dict[str, int]:
        out = {name: p.pid for name, p in self.procs.items()}
        if self.redis and self.redis.proc:
            out["redis"] = self.redis.proc.pid
        for k, shard in enumerate(self.shard_redis, start=1):
            if shard.proc:
                out[f"redis-shard-{k}"] = shard.proc.pid
        return out

    @property
    def redis_urls(self) -> list[str]:
        """The control Redis's URL, then the stream shards'."""
        return [self.redis.url, *(r.url for r in self.shard_redis)] if self.redis else []

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None and name not in self.stopped:
                raise RuntimeError(f"{name} exited:\n{self._exited_logs()}")

    def stop_only(self, names: list[str]) -> None:
        """Stop these processes now (by pid), the rest keep running."""
        for name in names:
            stop_owned(self.procs[name], grace_s=10)
            self.stopped.add(name)

    def stop(self) -> None:
        """Gateways first (no episode fails on a vanished engine), then the learner (its last
        push reaches the engines), then the rest; each by pid."""
        first = [n for n in self.procs if n.startswith("gateway")]
        stages = [first, ["learner"], [n for n in self.procs if n not in first and n != "learner"]]
        for names in stages:
            procs = [self.procs[n] for n in names if n in self.procs]
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                stop_owned(proc, grace_s=10)
        for server in [self.redis, *self.shard_redis]:
            if server:
                server.stop()
        shutil.rmtree(self.directory, ignore_errors=True)  # logs, AOF: read by check_alive before


def start_stack(config: StackConfig, profile: Path, attempts: int = 2) -> Stack:
    """A started Stack. A start that fails (a port another process took between its choice and
    the bind: a stack chooses tens of them) is tried again with fresh ports, `attempts` in all."""
    for attempt in range(1, attempts + 1):
        try:
            return Stack(config).start(profile)
        except RuntimeError as exc:
            if attempt == attempts:
                raise
            print(f"stack start failed, once more with fresh ports: {str(exc)[-600:]}")
    raise AssertionError("unreachable")


def _ports(urls: list[str]) -> list[int]:
    return [int(u.rsplit(":", 1)[1]) for u in urls]


def _listens(pid: int, port: int) -> bool:
    """Whether process `pid` holds a socket listening on TCP `port` (/proc/net/tcp{,6}: state 0A,
    the socket's inode among the process's fds)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{f[9]}]")
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd) in inodes:
                return True
        except OSError:
            continue
    return False
