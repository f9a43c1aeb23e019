"""docker-compose.yml, deploy/k8s, the main job (`shellrl run`, cli/main_job.py) and `shellrl up`
(the same recipe, cli/recipe.py) agree on every setting they share (issue 22, item 7; `up`: issue
34, item 3): for each service, every SHELLRL_ setting that any of them sets (a field of that
service's settings) resolves to the same value in all of them, where a
deployment that does not set it gets the settings class default. This is what caught the k8s
verifier running with `require_command` false (its default) while compose and the main job set it.

Placement settings (where things are: addresses, paths, devices, transports, threads) and
execution settings that change how a step is computed but not what it computes (the trainer's loss
does not depend on micro_batch_size; checkpointing and prefix sharing recompute the same values)
differ by design and are listed in PER_DEPLOYMENT with the reason."""

from __future__ import annotations

import os

import pytest
import yaml

from cli.job_config import JobConfig
from tests.service.test_deploy_compose import compose
from tests.service.test_deploy_k8s import container, manifests, workloads
from tests.service.test_deploy_settings import settings_class

PER_DEPLOYMENT = {
    # where things are
    "SHELLRL_HOST",
    "SHELLRL_PORT",
    "SHELLRL_REDIS_URL",
    "SHELLRL_ENGINE_URLS",
    "SHELLRL_SANDBOX_URL",
    "SHELLRL_VERIFIER_URL",
    "SHELLRL_ROLLOUT_URL",
    "SHELLRL_LEARNER_URL",
    "SHELLRL_MODEL_PATH",
    "SHELLRL_CHECKPOINT_DIR",
    "SHELLRL_WEIGHT_SYNC_DIR",
    "SHELLRL_TRACKING_DIR",
    "SHELLRL_API_TOKEN_FILE",  # where the mounted secret is (the launcher: its state directory)
    "SHELLRL_ENGINE_ADMIN_API_KEY_FILE",  # SGLang's admin key, mounted (the launcher: no SGLang)
    "SHELLRL_TASK_FILE_DIR",  # where the mounted task files are (the launcher mounts none)
    "SHELLRL_CONSUMER_NAME",
    "SHELLRL_DEVICE",
    "SHELLRL_ENGINE_CUDA_DEVICE",
    "SHELLRL_WEIGHT_TRANSPORT",
    "SHELLRL_NUM_THREADS",
    "SHELLRL_LOG_LEVEL",
    "SHELLRL_SHUTDOWN_GRACE_S",
    # how a learner step is computed on a 2-core CPU (same loss and gradients)
    "SHELLRL_MICRO_BATCH_SIZE",
    "SHELLRL_GRADIENT_CHECKPOINTING",
    "SHELLRL_SHARE_PREFIX_MIN_TOKENS",
    # the main job starts the learner paused and resumes it after the evaluation before training
    "SHELLRL_START_PAUSED",
    "SHELLRL_MAX_STEPS",  # its --steps (a deployment's runs set theirs through POST /v1/runs)
}
SERVICES = ("rollout", "sandbox", "verifier", "learner")


def compose_env(tmp_path) -> dict[str, dict[str, str]]:
    env_file = tmp_path / "empty.env"
    env_file.write_text("")
    done = compose("config", "--format", "json", env_file=env_file)
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    return {s: {k: str(v) for k, v in resolved[s]["environment"].items()} for s in SERVICES}


def k8s_env() -> dict[str, dict[str, str]]:
    configmap = next(doc for _, doc in manifests() if doc["kind"] == "ConfigMap")["data"]
    out = {}
    for service in SERVICES:
        env = dict(configmap)
        for item in container(workloads()[service]).get("env", []):
            env[item["name"]] = item.get("value", f"{service}-0")
        out[service] = env
    return out


def main_job_env() -> dict[str, dict[str, str]]:
    stack = JobConfig().stack_config()
    return {s: {**stack.common_env(), **stack.service_env.get(s, {})} for s in SERVICES}


def up_env() -> dict[str, dict[str, str]]:
    """`shellrl up`'s stack with its defaults (the main job's recipe, cli/recipe.py)."""
    from cli.commands.up import stack_config
    from cli.main import parse

    stack = stack_config(parse(["up", "--model-path", "tiny"]))
    return {s: {**stack.common_env(), **stack.service_env.get(s, {})} for s in SERVICES}


def resolved(service: str, env: dict[str, str], monkeypatch) -> dict:
    """The service's settings built from exactly `env` (defaults for what it does not set)."""
    for name in [n for n in os.environ if n.upper().startswith("SHELLRL_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return settings_class(service)().model_dump()


@pytest.mark.parametrize("service", SERVICES)
def test_compose_k8s_and_the_main_job_agree_on_every_shared_setting(service, tmp_path, monkeypatch):
    sources = {
        "compose": compose_env(tmp_path)[service],
        "k8s": k8s_env()[service],
        "main job": main_job_env()[service],
        "shellrl up": up_env()[service],
    }
    fields = set(settings_class(service).model_fields)
    compared = sorted(
        {
            n
            for env in sources.values()
            for n in env
            if n.startswith("SHELLRL_")
            and n not in PER_DEPLOYMENT
            and n.removeprefix("SHELLRL_").lower() in fields
        }
    )
    values = {name: resolved(service, env, monkeypatch) for name, env in sources.items()}
    disagree = {}
    for var in compared:
        field = var.removeprefix("SHELLRL_").lower()
        seen = {name: v[field] for name, v in values.items()}
        if len(set(map(repr, seen.values()))) > 1:
            disagree[var] = seen
    assert not disagree, f"{service}: {disagree}"


def test_the_comparison_covers_the_settings_that_matter():
    """The RL recipe is compared for the services that read it (a PER_DEPLOYMENT entry or a source
    dropping a setting would otherwise silently shrink the test)."""
    job = main_job_env()
    for service, names in {
        "rollout": {
            "SHELLRL_GROUP_SIZE",
            "SHELLRL_GROUPS_PER_STEP",
            "SHELLRL_MAX_STALENESS",
            "SHELLRL_TEMPERATURE",
            "SHELLRL_MAX_TURNS",
            "SHELLRL_MAX_NEW_TOKENS",
        },
        "learner": {
            "SHELLRL_LR",
            "SHELLRL_KL_COEF",
            "SHELLRL_GROUPS_PER_STEP",
            "SHELLRL_MAX_STALENESS",
        },
        "verifier": {"SHELLRL_REQUIRE_COMMAND"},
    }.items():
        assert names <= set(job[service]) and not names & PER_DEPLOYMENT, service
    assert k8s_env()["verifier"]["SHELLRL_REQUIRE_COMMAND"] == "true"
