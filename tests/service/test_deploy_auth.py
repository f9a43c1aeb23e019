"""The stack's token in docker-compose.yml and deploy/k8s (issue 17 item 8): every shellrl
container reads it from a mounted secret file, and the SGLang engine gets the same token as its
`--api-key`, through a `--config` YAML its own parser turns into that flag (no token in a command
line), so the header our clients send passes SGLang 0.5.23's own auth decision. SGLang's
`--admin-api-key` (issue 30 item 5) comes the same way from a second secret that only the engine
and the learner mount; the learner reads it from SHELLRL_ENGINE_ADMIN_API_KEY_FILE."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import yaml

from shellrl.clients.transport import auth_headers
from tests.helpers.owned_processes import run_owned
from tests.helpers.sglang_modules import wheel_root
from tests.service.test_deploy_compose import ENV_EXAMPLE, rendered
from tests.service.test_deploy_k8s import K8S_DIR, container, manifests, workloads

SHELLRL_SERVICES = ("rollout", "sandbox", "verifier", "learner")
TOKEN = "deploy-token-0123456789_abc-DEF.~+/=="
ADMIN_KEY = "deploy-admin-key-0123456789_xyz-UVW"


def _sglang_file(relative: str):
    """A module of the installed SGLang wheel, loaded from its file alone (these two import only
    the standard library and yaml, not the GPU stack that `import sglang` pulls in). The wheel
    is found through the bare package a conformance test may have registered before in this
    process (find_spec raises on it: how this module failed after those, under pytest-xdist)."""
    root = wheel_root()
    name = f"sglang_file_{Path(relative).stem}"
    if name not in sys.modules:  # registered first: its dataclasses look their module up
        spec = importlib.util.spec_from_file_location(name, root / relative)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def _sglang_argv_from(script: str, token_path: str, tmp_path: Path, admin_path: str) -> list[str]:
    """Run the engine's entrypoint `script` with the token at `token_path` and the admin key at
    `admin_path` replaced by files in `tmp_path` and a stand-in `python3` that prints its
    arguments; then SGLang's own ConfigArgumentMerger expands the `--config` YAML the script
    wrote, as `sglang.launch_server` does."""
    import argparse

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    admin_file = tmp_path / "admin_key"
    admin_file.write_text(ADMIN_KEY + "\n")
    python3 = tmp_path / "bin" / "python3"
    python3.parent.mkdir()
    python3.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    python3.chmod(0o755)
    script = script.replace("/tmp/sglang-auth.yaml", str(tmp_path / "auth.yaml"))
    script = script.replace(token_path, str(token_file)).replace(admin_path, str(admin_file))
    done = run_owned(
        ["sh", "-c", script, "sglang", "--port", "30000"],
        env={"PATH": f"{python3.parent}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
        timeout_s=120,
    )
    argv = done.stdout.split("\n")[2:-1]  # after "-m sglang.launch_server"
    parser = argparse.ArgumentParser()
    for flag in ("--api-key", "--admin-api-key", "--port", "--config"):
        parser.add_argument(flag)
    merger = _sglang_file("srt/utils/server_args_config_parser.py").ConfigArgumentMerger(parser)
    return merger.merge_config_with_args(argv)


def _sglang_allows(headers: dict[str, str], api_key: str, path: str = "/generate") -> bool:
    auth = _sglang_file("srt/utils/auth.py")
    return auth.decide_request_auth(
        method="POST",
        path=path,
        authorization_header=headers.get("Authorization"),
        api_key=api_key,
        admin_api_key=None,
        auth_level=auth.AuthLevel.ADMIN_OPTIONAL,
    ).allowed


def test_the_header_our_clients_send_passes_sglang_s_own_api_key_check():
    assert _sglang_allows(auth_headers(TOKEN), TOKEN)
    assert not _sglang_allows(auth_headers("another-token-0123456789"), TOKEN)
    assert not _sglang_allows({}, TOKEN)


def test_compose_gives_every_container_the_token_as_a_secret_file(tmp_path):
    env_file = tmp_path / "empty.env"
    env_file.write_text("")
    model = rendered(env_file)
    services, secret = model["services"], model["secrets"]["api_token"]
    assert secret["file"].endswith("/secrets/api_token")
    assert "SHELLRL_API_TOKEN_SECRET=./secrets/api_token" in ENV_EXAMPLE.read_text()
    for name in (*SHELLRL_SERVICES, "engine"):
        mounted = {m["source"]: m["target"] for m in services[name]["secrets"]}
        expected = {"api_token": "/run/secrets/api_token"}
        if name in ("engine", "learner"):  # SGLang's admin key: only these two
            expected["engine_admin_key"] = "/run/secrets/engine_admin_key"
        assert mounted == expected, name
    assert model["secrets"]["engine_admin_key"]["file"].endswith("/secrets/engine_admin_key")
    assert "SHELLRL_ENGINE_ADMIN_KEY_SECRET=./secrets/engine_admin_key" in ENV_EXAMPLE.read_text()
    learner_env = services["learner"]["environment"]
    assert learner_env["SHELLRL_ENGINE_ADMIN_API_KEY_FILE"] == "/run/secrets/engine_admin_key"
    for name in SHELLRL_SERVICES:
        env = services[name]["environment"]
        assert env["SHELLRL_API_TOKEN_FILE"] == "/run/secrets/api_token"
        assert "SHELLRL_API_TOKEN" not in env and "SHELLRL_AUTH_DISABLED" not in env


def test_compose_starts_sglang_with_the_token_as_its_api_key(tmp_path):
    env_file = tmp_path / "empty.env"
    env_file.write_text("")
    entrypoint = rendered(env_file)["services"]["engine"]["entrypoint"]
    assert entrypoint[:2] == ["sh", "-c"] and TOKEN not in " ".join(entrypoint)
    script = entrypoint[2].replace("$$", "$")  # compose's escape, as the container sees it
    argv = _sglang_argv_from(
        script, "/run/secrets/api_token", tmp_path, "/run/secrets/engine_admin_key"
    )
    assert argv[argv.index("--api-key") + 1] == TOKEN and "30000" in argv
    assert argv[argv.index("--admin-api-key") + 1] == ADMIN_KEY


def test_kubernetes_mounts_the_generated_secret_where_the_settings_look(tmp_path):
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    generator, admin = kustomization["secretGenerator"]
    assert generator["files"] == ["token=secrets/api_token"]
    assert admin["files"] == ["admin_key=secrets/engine_admin_key"]
    configmap = next(doc for _, doc in manifests() if doc["kind"] == "ConfigMap")["data"]
    token_file = Path(configmap["SHELLRL_API_TOKEN_FILE"])
    found = workloads()
    for name in (*SHELLRL_SERVICES, "engine"):
        pod = found[name]["spec"]["template"]["spec"]
        secrets = {v["secret"]["secretName"]: v for v in pod["volumes"] if "secret" in v}
        volume = secrets[generator["name"]]
        assert volume["secret"] == {"secretName": generator["name"], "defaultMode": 0o400}
        # SGLang's admin key: the engine and the learner only
        assert (admin["name"] in secrets) == (name in ("engine", "learner")), name
        mounts = {m["name"]: m for m in container(found[name])["volumeMounts"]}
        assert mounts[volume["name"]]["mountPath"] == str(token_file.parent), name
        assert mounts[volume["name"]]["readOnly"] is True
    engine = container(found["engine"])
    assert engine["command"][:2] == ["sh", "-c"]
    script = engine["command"][2].replace("$$", "$")  # Kubernetes' escape of `$(`
    admin_mount = {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}["engine-admin-key"]
    argv = _sglang_argv_from(script, str(token_file), tmp_path, f"{admin_mount}/admin_key")
    assert argv[argv.index("--api-key") + 1] == TOKEN
    assert argv[argv.index("--admin-api-key") + 1] == ADMIN_KEY
    learner = container(found["learner"])
    env = {e["name"]: e.get("value") for e in learner["env"]}
    mounts = {m["name"]: m["mountPath"] for m in learner["volumeMounts"]}
    assert env["SHELLRL_ENGINE_ADMIN_API_KEY_FILE"] == f"{mounts['engine-admin-key']}/admin_key"
