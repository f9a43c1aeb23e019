"""The environment docker-compose.yml and deploy/k8s give each service is one its settings accept:
every SHELLRL_ variable is a setting of the service that gets it (or, for the URLs every service
receives, of some service), and the service's settings class builds from it without an error."""

from __future__ import annotations

import importlib
import os

import pytest
import yaml

from shellrl.service.settings import ServiceSettings
from tests.service.test_deploy_compose import compose
from tests.service.test_deploy_k8s import container, manifests, workloads

SERVICES = ("rollout", "sandbox", "verifier", "learner", "engine")
SHARED = {
    "SHELLRL_HOST",
    "SHELLRL_PORT",
    "SHELLRL_REDIS_URL",
    "SHELLRL_LOG_LEVEL",
    "SHELLRL_SHUTDOWN_GRACE_S",
    "SHELLRL_ENGINE_URLS",
    "SHELLRL_SANDBOX_URL",
    "SHELLRL_VERIFIER_URL",
    "SHELLRL_ROLLOUT_URL",
    "SHELLRL_LEARNER_URL",
    "SHELLRL_MODEL_PATH",
    "SHELLRL_GROUP_SIZE",
    "SHELLRL_GROUPS_PER_STEP",
    "SHELLRL_MAX_STALENESS",
    "SHELLRL_MAX_TURNS",
    "SHELLRL_MAX_NEW_TOKENS",
    "SHELLRL_TEMPERATURE",
}
"""Variables a shared block (compose anchor, k8s ConfigMap) gives every service; each must still be a
setting of at least one service."""


def settings_class(service: str) -> type[ServiceSettings]:
    module = importlib.import_module(f"services.{service}.settings")
    [cls] = [
        v
        for v in vars(module).values()
        if isinstance(v, type)
        and issubclass(v, ServiceSettings)
        and v is not ServiceSettings
        and v.__module__ == module.__name__
    ]
    return cls


def fields(service: str) -> set[str]:
    return {f"SHELLRL_{name.upper()}" for name in settings_class(service).model_fields}


def check_environment(service: str, env: dict[str, str], monkeypatch) -> None:
    known = set().union(*(fields(s) for s in SERVICES))
    for name in env:
        if name.startswith("SHELLRL_"):
            assert name in known, f"{service}: {name} is no setting of any service"
            assert name in fields(service) or name in SHARED, (
                f"{service}: {name} is no setting of {service}"
            )
    for name in [n for n in os.environ if n.upper().startswith("SHELLRL_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings_class(service)()  # typo check and field validation


@pytest.mark.parametrize("service", ("rollout", "sandbox", "verifier", "learner"))
def test_compose_environment_is_accepted_by_the_service_settings(service, tmp_path, monkeypatch):
    env_file = tmp_path / "empty.env"
    env_file.write_text("")
    done = compose("config", "--format", "json", env_file=env_file)
    assert done.returncode == 0, done.stderr
    environment = yaml.safe_load(done.stdout)["services"][service]["environment"]
    check_environment(service, {k: str(v) for k, v in environment.items()}, monkeypatch)


@pytest.mark.parametrize("service", ("rollout", "sandbox", "verifier", "learner"))
def test_k8s_environment_is_accepted_by_the_service_settings(service, monkeypatch):
    configmap = next(doc for _, doc in manifests() if doc["kind"] == "ConfigMap")["data"]
    env = dict(configmap)
    for item in container(workloads()[service]).get("env", []):
        env[item["name"]] = item.get(
            "value", f"{service}-0"
        )  # fieldRef metadata.name -> the pod name
    check_environment(service, env, monkeypatch)
