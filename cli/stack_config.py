"""The configuration of a local stack: which services, on which ports, devices and environment.

`StackConfig` is what `shellrl up` starts (cli/launcher.py starts and stops the processes);
`device_env` puts engine and learner on the CPU, on one GPU they share, or on two GPUs, one each
(`GPU_LAYOUTS`); `api_headers` is
the `Authorization` header the CLI sends to a running stack (its token: shellrl/service/auth.py).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from cli.errors import CliError
from shellrl.clients.transport import auth_headers
from shellrl.service.auth import new_token

STATE_DIR = Path(os.environ.get("SHELLRL_STATE_DIR", ".shellrl"))
API_TOKEN_FILE = "api_token"  # <state dir>/api_token: the running stack's token, mode 0600
SERVICE_ORDER = ("engine", "sandbox", "verifier", "rollout", "learner")
DEFAULT_PORTS = {
    "redis": 6399,
    "engine": 30000,
    "sandbox": 8101,
    "verifier": 8102,
    "rollout": 8100,
    "learner": 8103,
}
# --port-offset N moves every one of them by N (two stacks on one machine: `shellrl up
# --port-offset 1000 --state-dir .shellrl-b`); an offset leaving the port range is refused
MAX_PORT = 65535
DEVICES = ("cpu", "cuda")
GPU_SERVICES = ("engine", "learner")
# --device cuda colocates engine and learner on one GPU (the current one: CUDA_VISIBLE_DEVICES picks
# it), or splits them over two (GPU_LAYOUTS below). Fraction of that GPU's memory each process's
# caching allocator may hold: torch's `per_process_memory_fraction` (PYTORCH_ALLOC_CONF), so an
# allocation past it raises CUDA OOM in that process and never starves the other. The remaining
# 10% holds the two CUDA contexts (~0.5 GiB each) and what is allocated outside torch's allocator
# (the CUDA IPC mapping of a weight push).
GPU_MEMORY_FRACTIONS = {"engine": 0.4, "learner": 0.5}
# With no allocator options of the user's, the caching allocator also maps memory in segments that
# grow (expandable_segments) instead of fixed blocks: at a cap of 0.1 of an H100 the engine ran
# out of memory with 3.2-3.5 GiB of its 7.1-7.9 GiB reserved but unallocated (fragmentation;
# big4-s1 and bigbroad, 2026-12-06), and with this option the same caps ran 6 stacks of 6 without
# one OOM, CUDA IPC weight pushes included (BENCHMARKS.md, "Learning that transfers").
EXPANDABLE_SEGMENTS = "expandable_segments:True"
# where --device cuda puts engine and learner: "colocated" on the first visible GPU (the fractions
# above share it), "split" on the first two visible GPUs (engine on the first, learner on the
# second, each within its fraction of its own GPU; the learner also sees the engine's GPU, where it
# stages the CUDA IPC bucket of a push), "auto": split when torch sees two or more GPUs
GPU_LAYOUTS = ("auto", "colocated", "split")
# split: the engine's GPU also holds the learner's CUDA context (~0.5 GiB) and each push's bucket
# (the model in bf16: 0.27 GB for SmolLM2-135M, 15.2 GB for a 7B model)
SPLIT_ENGINE_MAX_FRACTION = 0.85


def resolve_gpu_layout(layout: str, gpu_count: int) -> str:
    """ "colocated" or "split" for `layout` (GPU_LAYOUTS) on a host where torch sees `gpu_count`
    GPUs. Raises CliError for an unknown layout or "split" with fewer than two GPUs."""
    if layout not in GPU_LAYOUTS:
        raise CliError(f"--gpu-layout {layout}: expected one of {', '.join(GPU_LAYOUTS)}")
    if layout == "auto":
        return "split" if gpu_count >= 2 else "colocated"
    if layout == "split" and gpu_count < 2:
        raise CliError(
            f"--gpu-layout split: needs two GPUs, torch sees {gpu_count}; use --gpu-layout colocated"
        )
    return layout


def check_device(
    device: str, gpu_memory: dict[str, float] | None = None, gpu_layout: str = "auto"
) -> str:
    """Raise CliError (one line, exit status 2) unless `device` can run here: 'cpu' always; 'cuda'
    needs a torch that sees a GPU (two for `gpu_layout` "split"), and GPU memory fractions
    (service -> fraction) in (0, 1] that, for services colocated on one GPU, sum to at most 1.
    Returns the layout engine and learner get ("colocated" or "split", `resolve_gpu_layout`;
    "colocated" for 'cpu'). Imports torch for 'cuda' only."""
    if device not in DEVICES:
        raise CliError(f"--device {device}: expected one of {', '.join(DEVICES)}")
    if gpu_layout not in GPU_LAYOUTS:
        raise CliError(f"--gpu-layout {gpu_layout}: expected one of {', '.join(GPU_LAYOUTS)}")
    if device == "cpu":
        return "colocated"
    fractions = gpu_memory or GPU_MEMORY_FRACTIONS

    def check_fractions(layout: str) -> None:
        shown = ", ".join(f"{name} {f:g}" for name, f in fractions.items())
        shared = layout == "colocated" and sum(fractions.values()) > 1
        if shared or not all(0 < f <= 1 for f in fractions.values()):
            raise CliError(
                f"--device cuda: GPU memory fractions ({shown}) must be in (0, 1]"
                + (" and sum to at most 1 (engine and learner share one GPU)" if shared else "")
            )
        if layout == "split" and fractions.get("engine", 0) > SPLIT_ENGINE_MAX_FRACTION:
            raise CliError(
                f"--device cuda --gpu-layout split: the engine's fraction ({shown}) must be at "
                f"most {SPLIT_ENGINE_MAX_FRACTION:g}: the learner's CUDA context and each push's "
                "bucket live on the engine's GPU too"
            )

    check_fractions(gpu_layout)  # before torch is asked, where the layout is known already
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise CliError(
            f"--device cuda: no CUDA GPU visible to torch {torch.__version__} "
            f"({build}); use --device cpu"
        )
    layout = resolve_gpu_layout(gpu_layout, torch.cuda.device_count())
    check_fractions(layout)
    return layout


def device_env(
    device: str,
    service: str,
    gpu_memory: dict[str, float] | None = None,
    environ: dict[str, str] | None = None,
    layout: str = "colocated",
) -> dict[str, str]:
    """Environment that puts `service` on `device` (see GPU_MEMORY_FRACTIONS, GPU_LAYOUTS). cpu:
    engine and learner on the CPU. cuda, layout "colocated": engine (bfloat16) and learner on the
    current GPU, each capped at its fraction of the GPU's memory; "split": the engine alone on the
    first visible GPU, the learner on the second (`cuda:1` of the two it sees, the engine's being
    its `cuda:0`, where its CUDA IPC buckets go: SHELLRL_ENGINE_CUDA_DEVICE), each capped at its
    fraction. The visible GPUs are those CUDA_VISIBLE_DEVICES in `environ` (default os.environ)
    lists, else 0 and 1. The other services see no GPU. A PYTORCH_CUDA_ALLOC_CONF or
    PYTORCH_ALLOC_CONF already in `environ` keeps its options (its fraction replaced); without
    one the options are EXPANDABLE_SEGMENTS and the fraction."""
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
    if not options:  # the user's own allocator options stay theirs; else segments that grow
        options = [EXPANDABLE_SEGMENTS]
    budget = f"per_process_memory_fraction:{fraction:g}"
    env = {"SHELLRL_DEVICE": "cuda", name: ",".join([*options, budget])}
    if service == "engine":
        env["SHELLRL_DTYPE"] = "bfloat16"
    if layout == "split":
        listed = environ.get("CUDA_VISIBLE_DEVICES", "")
        gpus = [g.strip() for g in listed.split(",") if g.strip()] or ["0", "1"]
        if len(gpus) < 2:
            raise CliError(f"--gpu-layout split: CUDA_VISIBLE_DEVICES={listed} names one GPU")
        engine_gpu, learner_gpu = gpus[:2]
        if service == "engine":
            env["CUDA_VISIBLE_DEVICES"] = engine_gpu
        else:
            env |= {
                "CUDA_VISIBLE_DEVICES": f"{engine_gpu},{learner_gpu}",
                "SHELLRL_DEVICE": "cuda:1",
                "SHELLRL_ENGINE_CUDA_DEVICE": "cuda:0",
            }
    return env


def shifted_ports(offset: int = 0) -> dict[str, int]:
    """DEFAULT_PORTS, each moved by `offset` ({service: port}, Redis included). Raises CliError
    (one line) for a negative offset or one that moves a port past MAX_PORT."""
    highest = max(DEFAULT_PORTS.values())
    if not 0 <= offset <= MAX_PORT - highest:
        raise CliError(
            f"--port-offset {offset}: expected 0 to {MAX_PORT - highest} (the default ports "
            f"{default_ports_text()} move by it; the highest must stay <= {MAX_PORT})"
        )
    return {name: port + offset for name, port in DEFAULT_PORTS.items()}


def launcher_names(stack: StackConfig) -> set[str]:
    """SHELLRL_* names `stack` sets for its services (its env and service_env: the recipe, the
    job's options) or the launcher sets (ports, URLs, the device's, any device and layout): what
    a config file's [env] table may not set."""
    names = set(stack.common_env()) | {n for env in stack.service_env.values() for n in env}
    names |= {
        n
        for d in DEVICES
        for s in GPU_SERVICES
        for layout in ("colocated", "split")
        for n in device_env(d, s, environ={}, layout=layout)
        if n.startswith("SHELLRL_")
    }
    return names | {"SHELLRL_PORT", "SHELLRL_HOST"}


def default_ports_text() -> str:
    """'redis 6399, engine 30000, ...': the default ports, for help texts and errors."""
    return ", ".join(f"{name} {port}" for name, port in DEFAULT_PORTS.items())


def api_headers(state_dir: Path = STATE_DIR, environ: dict[str, str] | None = None) -> dict:
    """The `Authorization` header for a CLI call to a stack: the token of SHELLRL_API_TOKEN, else of
    the file SHELLRL_API_TOKEN_FILE names, else of `<state_dir>/api_token` (what `shellrl up`
    wrote); {} when there is none (a stack with auth disabled)."""
    environ = os.environ if environ is None else environ
    if environ.get("SHELLRL_API_TOKEN"):
        return auth_headers(environ["SHELLRL_API_TOKEN"])
    path = Path(environ.get("SHELLRL_API_TOKEN_FILE") or state_dir / API_TOKEN_FILE)
    try:
        return auth_headers(path.read_text().strip())
    except OSError:
        return {}


def gateway_url(
    url: str | None, state_dir: Path = STATE_DIR, environ: dict[str, str] | None = None
) -> str:
    """The rollout gateway a CLI call goes to: `url` when given, else SHELLRL_ROLLOUT_URL, else
    the rollout of the stack running from `state_dir` (its stack.json: a stack moved by
    --port-offset), else port 8100."""
    environ = os.environ if environ is None else environ
    if url or environ.get("SHELLRL_ROLLOUT_URL"):
        return url or environ["SHELLRL_ROLLOUT_URL"]
    try:
        return json.loads((state_dir / "stack.json").read_text())["urls"]["rollout"]
    except (OSError, ValueError, KeyError, TypeError):  # no stack runs from there: the default
        return f"http://127.0.0.1:{DEFAULT_PORTS['rollout']}"


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
    fractions with 'cuda', gpu_layout: "colocated" (one GPU shared) or "split" (one each);
    api_token: the stack's bearer token (a fresh random one per config), which every service
    requires and sends (cli/launcher.py hands it over in a 0600 file)."""

    state_dir: Path = STATE_DIR
    model_path: str = "smollm2"
    device: str = "cpu"
    gpu_memory: dict[str, float] = field(default_factory=lambda: dict(GPU_MEMORY_FRACTIONS))
    gpu_layout: str = "colocated"  # with device 'cuda': "colocated" or "split" (GPU_LAYOUTS)
    ports: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_PORTS))
    env: dict[str, str] = field(default_factory=dict)
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)
    services: tuple[str, ...] = SERVICE_ORDER
    ready_timeout_s: float = 300.0
    echo_logs: bool = True
    api_token: str = field(default_factory=new_token, repr=False)

    def url(self, service: str) -> str:
        return f"http://127.0.0.1:{self.ports[service]}"

    def auth_headers(self) -> dict[str, str]:
        """`{"Authorization": "Bearer <api_token>"}` for calls to this stack's services."""
        return auth_headers(self.api_token)

    @property
    def api_token_file(self) -> Path:
        return self.state_dir / API_TOKEN_FILE

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
