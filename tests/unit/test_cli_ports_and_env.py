"""`--port-offset` for `shellrl up`, `run` and `eval`, and the `[env]` table of a config file
checked by the services' own Settings classes before anything starts (issue 34, items 2 and 4)."""

from __future__ import annotations

import pytest

from cli.commands import run as run_command
from cli.commands import up as up_command
from cli.config_file import check_env_values
from cli.errors import CliError
from cli.main import main, parse
from cli.stack_config import DEFAULT_PORTS, shifted_ports


def write(tmp_path, text: str):
    path = tmp_path / "shellrl.toml"
    path.write_text(text)
    return path


def test_port_offset_moves_every_port_of_up_and_run_and_every_url_they_build(tmp_path):
    state = str(tmp_path / "state")
    up = up_command.stack_config(parse(["up", "--model-path", "tiny", "--port-offset", "1000"]))
    job = run_command.job_config(parse(["run", "--state-dir", state, "--port-offset", "1000"]))
    for config in (up, job.stack_config()):
        assert config.ports == {name: port + 1000 for name, port in DEFAULT_PORTS.items()}
        env = config.common_env()
        assert env["SHELLRL_REDIS_URL"] == f"redis://127.0.0.1:{DEFAULT_PORTS['redis'] + 1000}/0"
        for service in ("engine", "sandbox", "verifier", "rollout", "learner"):
            url = f"http://127.0.0.1:{DEFAULT_PORTS[service] + 1000}"
            assert config.url(service) == url
            assert url in env[f"SHELLRL_{service.upper()}_URL{'S' * (service == 'engine')}"]
    assert up_command.stack_config(parse(["up", "--model-path", "tiny"])).ports == DEFAULT_PORTS


@pytest.mark.parametrize("offset", [-1, 65535 - max(DEFAULT_PORTS.values()) + 1])
def test_a_port_offset_out_of_range_is_refused_naming_the_flag(offset):
    with pytest.raises(CliError, match=f"--port-offset {offset}: expected 0 to"):
        shifted_ports(offset)


def test_port_offset_moves_the_default_gateway_url_of_eval_and_the_learner_of_attach(monkeypatch):
    from cli.attached_job import default_learner_url

    monkeypatch.delenv("SHELLRL_ROLLOUT_URL", raising=False)
    args = parse(["eval", "--port-offset", "7"])
    assert args.url is None and shifted_ports(args.port_offset)["rollout"] == 8107
    assert default_learner_url("http://host:8107", 7) == "http://host:8110"


def test_env_port_in_a_config_file_is_refused_naming_the_flag(tmp_path, capsys):
    path = write(tmp_path, "[env]\nSHELLRL_PORT = 9000\n")
    assert main(["up", "--config", str(path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"shellrl up: error: config file {path}: [env] SHELLRL_PORT: set by the launcher for "
        "each service; use --port-offset N (every port of the stack moved by N)"
    ]


@pytest.mark.parametrize(
    "line, message",
    [
        ('SHELLRL_MAX_SESSIONS = "lots"', "SHELLRL_MAX_SESSIONS='lots': sandbox: Input should be"),
        ("SHELLRL_MAX_SESSIONS = 5000", "SHELLRL_MAX_SESSIONS='5000': sandbox: Input should be"),
        ("SHELLRL_TOP_K = 0", "SHELLRL_TOP_K='0': rollout: top_k must be -1"),
        ('SHELLRL_SANDBOX_ISOLATION = "box"', "SHELLRL_SANDBOX_ISOLATION='box': sandbox: Input"),
        ('SHELLRL_LR = "fast"', "SHELLRL_LR='fast': learner: Input should be a valid number"),
        ('SHELLRL_API_TOKEN = "short"', "SHELLRL_API_TOKEN='***': rollout: api_token: an API"),
    ],
)
def test_a_bad_env_value_stops_up_and_run_before_any_process_starts(
    tmp_path, capsys, monkeypatch, line, message
):
    from cli import launcher

    started = []
    monkeypatch.setattr(launcher.Stack, "start", lambda self: started.append(self))
    path = write(tmp_path, f"[env]\nSHELLRL_MAX_NEW_TOKENS = 8\n{line}\n")
    for command in ("up", "run"):
        argv = [command, "--config", str(path), "--model-path", "tiny"]
        assert main([*argv, "--state-dir", str(tmp_path / "state")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"config file {path}: [env] {message}" in err[0], err
    assert started == [] and not (tmp_path / "state").exists()


def test_good_env_values_pass_every_service_that_reads_them():
    check_env_values(
        {
            "SHELLRL_MAX_SESSIONS": "16",
            "SHELLRL_GROUPS_PER_STEP": "2",  # rollout and learner both read it
            "SHELLRL_OVERLONG_FILTERING": "true",
            "SHELLRL_ISOLATION": "fallback",
        }
    )


def test_show_and_submit_reach_the_gateway_of_the_stack_in_their_state_dir(tmp_path):
    # a second stack on shifted ports: `--state-dir` sent its token to the first stack's port
    # 8100 unless --url was given too
    import json

    from cli.stack_config import gateway_url

    state = tmp_path / "stack-b"
    assert gateway_url(None, state, environ={}) == "http://127.0.0.1:8100"  # no stack there
    state.mkdir()
    (state / "stack.json").write_text(json.dumps({"urls": {"rollout": "http://127.0.0.1:9100"}}))
    assert gateway_url(None, state, environ={}) == "http://127.0.0.1:9100"
    env = {"SHELLRL_ROLLOUT_URL": "http://gw:8100"}
    assert gateway_url(None, state, environ=env) == "http://gw:8100"
    assert gateway_url("http://given:1", state, environ=env) == "http://given:1"
    for argv in (["show", "some-id"], ["submit", "tasks.jsonl"]):
        assert parse([*argv, "--state-dir", str(state)]).url is None  # resolved when it runs
