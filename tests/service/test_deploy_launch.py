"""The deployments' own command lines, run for real (issue 18, item 4): what deploy/k8s and the
compose profile `two-engines` start, with only their addresses replaced by this machine's.

* The engine registration sidecar (deploy/k8s/engine.yaml, Kubernetes' $(VAR) expansion with the
  pod IP of the downward API; docker-compose.yml's `engine-2-registration`, as `docker compose
  config` renders it): beside a real engine it registers the engine's address in `shellrl:engines`
  of a real Redis, the compose healthcheck turns healthy then, and SIGTERM (a pod or container
  going away) deletes the registration.
* The learner StatefulSets' torchrun (deploy/k8s/learner.yaml) as two pods of one GPU-less rank
  each: node ranks 0 and 1 (the StatefulSet ordinals) meet at node 0's rendezvous and node 0's
  rank 0 serves a learner of world size 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from shellrl.streams.keys import ENGINES_KEY
from tests.helpers.engine import running_engine
from tests.helpers.owned_processes import popen_owned, run_owned, stop_owned
from tests.helpers.processes import REPO
from tests.helpers.redis_server import free_port
from tests.helpers.waiting import wait_until
from tests.service.test_deploy_compose import TWO_ENGINES, rendered
from tests.service.test_deploy_k8s import container, expanded, workloads
from tests.service.test_learner_data_parallel import learner_env

pytestmark = pytest.mark.slow  # a real engine, a real learner of two torchrun agents


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A real engine (shellrl's CPU engine, the tiny model) that does not register itself."""
    with running_engine(tmp_path_factory.mktemp("engine")) as proc:
        yield proc


def k8s_command(main: dict, env: dict[str, str]) -> list[str]:
    """A container's command and args after Kubernetes' $(VAR) expansion from `env`."""
    return [expanded(arg, env) for arg in main["command"] + main.get("args", [])]


@dataclass
class Sidecar:
    """A registration sidecar's command line, environment and (compose) healthcheck command."""

    argv: list[str]
    env: dict[str, str]
    healthcheck: list[str] | None = None


def k8s_sidecar(engine_url: str, redis_url: str) -> Sidecar:
    """engine.yaml's registration container as the kubelet would start it in a pod whose IP is
    this engine's host, SGLang's port replaced by this engine's."""
    pod = workloads()["engine"]["spec"]["template"]["spec"]
    [sglang] = [c for c in pod["containers"] if c["name"] == "sglang"]
    [sidecar] = [c for c in pod["containers"] if c["name"] == "registration"]
    host = engine_url.removeprefix("http://").split(":")[0]
    env = {"POD_IP": host, "SHELLRL_MODEL_PATH": "tiny", "SHELLRL_REDIS_URL": redis_url}
    advertised = f"http://{host}:{sglang['ports'][0]['containerPort']}"
    argv = [a.replace(advertised, engine_url) for a in k8s_command(sidecar, env)]
    return Sidecar(argv, env)


def compose_sidecar(engine_url: str, redis_url: str, env_file: Path) -> Sidecar:
    """docker-compose.yml's engine-2-registration, engine-2's address and the model replaced."""
    sidecar = rendered(env_file, TWO_ENGINES)["services"]["engine-2-registration"]
    argv = sidecar["command"]
    url, model = argv[argv.index("--engine-url") + 1], argv[argv.index("--model-path") + 1]
    argv = [{url: engine_url, model: "tiny"}.get(a, a) for a in argv]
    healthcheck = [a.replace(url, engine_url) for a in sidecar["healthcheck"]["test"][1:]]
    env = {**sidecar["environment"], "SHELLRL_REDIS_URL": redis_url}
    return Sidecar(argv, env, healthcheck)


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """`cmd` as an owned process (its own group), output appended to `log`; `stop_owned` stops it."""
    with open(log, "ab") as out:
        return popen_owned(
            cmd,
            cwd=REPO,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.parametrize("deployment", ["k8s", "compose"])
def test_the_registration_sidecar_registers_its_engine_and_withdraws_it_at_sigterm(
    deployment, engine, redis_server, tmp_path
):
    client = redis.Redis.from_url(redis_server.url)
    if deployment == "k8s":
        sidecar = k8s_sidecar(engine.url, redis_server.url)
    else:
        (tmp_path / "empty.env").write_text("")
        sidecar = compose_sidecar(engine.url, redis_server.url, tmp_path / "empty.env")

    def healthy() -> bool:  # compose's healthcheck of the sidecar, run as in its container
        assert sidecar.healthcheck and sidecar.healthcheck[0] == "python"
        done = run_owned(
            [sys.executable, *sidecar.healthcheck[1:]],
            env={**os.environ, **sidecar.env},
            capture_output=True,
            timeout_s=30,
        )
        return done.returncode == 0

    if sidecar.healthcheck:
        assert not healthy()  # nothing registered yet
    log = tmp_path / "sidecar.log"
    assert sidecar.argv[0] == "python"
    proc = start([sys.executable, *sidecar.argv[1:]], sidecar.env, log)
    try:
        wait_until(lambda: client.hexists(ENGINES_KEY, engine.url), 60, "the engine's registration")
        entry = json.loads(client.hget(ENGINES_KEY, engine.url))
        assert entry["url"] == engine.url and entry["model"] == "tiny" and not entry["leaving"]
        if sidecar.healthcheck:
            assert healthy()
    finally:
        code = stop_owned(proc, grace_s=30)
    assert code == 0, log.read_text()[-3000:]
    assert not client.hexists(ENGINES_KEY, engine.url), "SIGTERM must delete the registration"


def test_the_learner_statefulsets_torchrun_forms_one_learner_across_two_pods(
    redis_server, tmp_path
):
    """learner-0 (node 0) and learner-worker-1 (node 1) with LEARNER_NNODES 2 (learner-worker
    replicas 1): one rank each, CPU and gloo instead of the pods' GPUs."""
    port = free_port()
    local = {"--master-addr": "127.0.0.1", "--master-port": str(free_port())}  # learner-0.learner
    env = learner_env(redis_server.url, "", tmp_path, port=port, device="cpu")
    env |= {
        "OMP_NUM_THREADS": "1",
        "SHELLRL_LOCK_TTL_S": "5",
        "SHELLRL_DISTRIBUTED_TIMEOUT_S": "30",
    }
    procs = []
    try:
        for name, node_rank in (("learner", "0"), ("learner-worker", "1")):
            pod = {"LEARNER_NNODES": "2", "LEARNER_NPROC_PER_NODE": "1"}
            pod["LEARNER_NODE_RANK"] = node_rank  # the pod-index label, by the downward API
            argv = k8s_command(container(workloads()[name]), pod)
            assert argv[0] == "torchrun"
            argv = [
                f"{flag}={local[flag]}" if (flag := a.split("=")[0]) in local else a
                for a in argv[1:]
            ]
            cmd = [sys.executable, "-m", "torch.distributed.run", *argv]
            procs.append(start(cmd, env | pod, tmp_path / f"{name}.log"))

        def status() -> dict | None:
            for proc in procs:
                assert proc.poll() is None, (tmp_path / "learner.log").read_text()[-4000:]
            try:
                return httpx.get(f"http://127.0.0.1:{port}/v1/status", timeout=5).json()
            except httpx.HTTPError:
                return None

        wait_until(status, 180, "the learner's rank 0 serving")
        assert status()["world_size"] == 2
        leader_code = stop_owned(
            procs[0], grace_s=90
        )  # SIGTERM: rank 0 drains and sends the followers STOP
        worker_code = procs[1].wait(60)  # node 1 ends by itself, not by a signal
    finally:
        for proc in procs:
            stop_owned(proc, grace_s=90)
    leader_log = (tmp_path / "learner.log").read_text()
    logs = leader_log + (tmp_path / "learner-worker.log").read_text()
    assert worker_code == 0, logs[-4000:]
    # torchrun itself ends with 1 after a SIGTERM it forwarded; rank 0 shut down cleanly
    assert leader_code == 1 and "Application shutdown complete" in leader_log, logs[-4000:]
