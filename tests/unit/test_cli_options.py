"""The `shellrl` command's options (issue 22, item 7): defaults in every --help, a TOML config file
for `run`/`up` that flags override, and mistakes (bad model path, bad config) reported as one line
before anything starts."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from cli.errors import CliError
from cli.main import build_parser, command_modules, parse
from cli.model_path import check_model_path
from tests.helpers.owned_processes import run_owned
from tests.helpers.processes import REPO


def shellrl(*args: str, cwd=REPO) -> subprocess.CompletedProcess:
    return run_owned(
        [sys.executable, "-m", "cli.main", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout_s=120,
    )


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    [sub] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def test_every_option_of_every_command_shows_its_default_in_help():
    commands = subparsers()
    assert {"run", "up", "down", "status", "submit", "export", "pass-rates"} <= set(commands)
    for name, parser in commands.items():
        for action in parser._actions:
            if not action.option_strings or action.default is argparse.SUPPRESS:
                continue
            formatter = parser._get_formatter()
            text = formatter._format_action(action)
            assert action.help, f"shellrl {name} {action.option_strings[0]} has no help text"
            assert "(default:" in " ".join(text.split()), (
                f"shellrl {name} {action.option_strings[0]}: {text}"
            )


def test_help_output_of_a_real_process_shows_defaults():
    done = shellrl("run", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "(default: smollm2)" in text and "(default: 0.7)" in text and "(default: 40)" in text


def test_every_command_module_defines_run_and_help():
    assert all(callable(m.run) and getattr(m, "HELP", "") for m in command_modules())


def write(tmp_path, text: str):
    path = tmp_path / "shellrl.toml"
    path.write_text(text)
    return path


def test_config_file_sets_defaults_and_flags_override_it(tmp_path):
    path = write(
        tmp_path,
        'model-path = "tiny"\nsteps = 7\nlr = 1\nno-require-command = true\n'
        "[run]\ntime_budget_min = 3\n[up]\nquiet = true\n"
        "[env]\nSHELLRL_MAX_SESSIONS = 16\nSHELLRL_OVERLONG_FILTERING = true\n",
    )
    args = parse(["run", "--config", str(path), "--steps", "9"])
    assert (args.model_path, args.steps, args.time_budget_min) == ("tiny", 9, 3.0)
    assert args.lr == 1.0 and isinstance(args.lr, float) and args.require_command is False
    assert args.config_env == {"SHELLRL_MAX_SESSIONS": "16", "SHELLRL_OVERLONG_FILTERING": "true"}
    assert parse(["run", "--config", str(path), "--model-path", "smollm2"]).model_path == "smollm2"
    assert parse(["run"]).steps == 40  # no file, the built-in default


def test_config_file_for_up_reads_its_table_and_rejects_options_it_does_not_have(tmp_path):
    ok = write(tmp_path, 'model-path = "tiny"\n[up]\nquiet = true\n[run]\nsteps = 3\n')
    args = parse(["up", "--config", str(ok)])
    assert args.model_path == "tiny" and args.quiet is True
    bad = write(tmp_path, "steps = 3\n")
    with pytest.raises(CliError, match="unknown option 'steps' for `shellrl up`"):
        parse(["up", "--config", str(bad)])


@pytest.mark.parametrize(
    "text, message",
    [
        ("steps = 'many'\n", "steps: expected int, got 'many'"),
        ("steps = 2.5\n", "steps: expected int, got 2.5"),
        ("fresh = 1\n", "fresh: expected true or false"),
        ("stepz = 3\n", "unknown option 'stepz'"),
        ("steps = \n", "Invalid value"),
        ("[runn]\nsteps = 3\n", "unknown table [runn]"),
        ("[env]\nSHELLRL_GROUP_SIZ = 8\n", "SHELLRL_GROUP_SIZ: no service has this setting"),
    ],
)
def test_config_file_mistakes_name_the_key(tmp_path, text, message):
    with pytest.raises(CliError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse(["run", "--config", str(write(tmp_path, text))])


def test_config_mistake_is_one_line_on_stderr_with_exit_status_2(tmp_path):
    path = write(tmp_path, "steps = 'many'\n")
    done = shellrl("run", "--config", str(path), "--state-dir", str(tmp_path / "state"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"shellrl run: error: config file {path}: steps: expected int, got 'many'"
    ]
    assert not (tmp_path / "state").exists()


def test_env_table_may_not_set_what_the_job_sets_from_its_options(tmp_path):
    path = write(tmp_path, "[env]\nSHELLRL_GROUP_SIZE = 4\n")
    done = shellrl(
        "run",
        "--config",
        str(path),
        "--model-path",
        str(tmp_path / "missing"),
        "--state-dir",
        str(tmp_path / "state"),
    )
    assert done.returncode == 2 and "--model-path" in done.stderr  # the model path is checked first
    model = tmp_path / "model"
    _hf_dir(model)
    done = shellrl(
        "run",
        "--config",
        str(path),
        "--model-path",
        str(model),
        "--state-dir",
        str(tmp_path / "state"),
    )
    assert done.returncode == 2, done.stderr
    assert "SHELLRL_GROUP_SIZE: set by the job from its options" in done.stderr
    assert not (tmp_path / "state").exists()


def _hf_dir(path, *, tokenizer=True, weights=True, config=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(
        json.dumps(config if config is not None else {"model_type": "llama"})
    )
    if weights:
        (path / "model.safetensors").write_bytes(b"")
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return path


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda p: None, "no such directory"),
        (lambda p: p.write_text("x"), "not a directory"),
        (lambda p: p.mkdir(), "no config.json"),
        (lambda p: _hf_dir(p, config={"hidden_size": 8}), "has no model_type"),
        (
            lambda p: _hf_dir(p, config={"model_type": "nonesuch"}),
            "model_type 'nonesuch' is no architecture",
        ),
        (lambda p: _hf_dir(p, weights=False), "no weights"),
        (lambda p: _hf_dir(p, tokenizer=False), "no tokenizer"),
    ],
)
def test_a_bad_model_path_names_what_is_missing(tmp_path, setup, message):
    path = tmp_path / "model"
    setup(path)
    with pytest.raises(CliError, match=message):
        check_model_path(str(path))


def test_builtin_models_and_a_real_model_directory_pass():
    from shellrl.models import resolve_model_path

    check_model_path("tiny")
    check_model_path(str(resolve_model_path("tiny")))


@pytest.mark.parametrize("command", ["run", "up", "pass-rates", "eval"])
def test_a_bad_model_path_fails_before_the_stack_starts_with_one_line(tmp_path, command):
    state = tmp_path / "state"
    done = shellrl(command, "--model-path", str(tmp_path / "nope"), "--state-dir", str(state))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"shellrl {command}: error: --model-path {tmp_path / 'nope'}: no such directory "
        "(expected smollm2 or "
        "tiny or a Hugging Face model directory)"
    ]
    assert not state.exists()  # nothing started: no Redis directory, no logs


def test_a_stack_that_fails_to_start_names_the_last_error_of_the_service_log(tmp_path):
    from cli.stack_failure import StackError, last_error_line

    log = tmp_path / "engine.log"
    log.write_text(
        '{"level": "INFO", "msg": "loading model"}\n'
        '{"level": "ERROR", "msg": "engine failed to start", "exc": "Traceback (most recent call '
        'last):\\n  File \\"x.py\\", line 1\\nOSError: model.safetensors: header too large"}\n'
        '{"level": "INFO", "msg": "shutting down"}\n'
    )
    assert (
        last_error_line(log)
        == "engine failed to start: OSError: model.safetensors: header too large"
    )
    plain = tmp_path / "plain.log"
    plain.write_text(
        'Traceback (most recent call last):\n  File "a.py", line 3, in <module>\n'
        "ValueError: bad config\n"
    )
    assert last_error_line(plain) == "ValueError: bad config"
    assert last_error_line(tmp_path / "missing.log") is None
    error = StackError("engine exited with status 1 before it was ready")
    assert (
        isinstance(error, CliError) and isinstance(error, RuntimeError) and error.exit_status == 1
    )


def test_a_service_that_dies_while_the_job_runs_is_named_with_its_last_error(tmp_path):
    """GPU run of 2026-12-02: a learner killed by CUDA OOM ended the job in an httpx traceback;
    the job now stops at its next poll naming the service, its status and its log's cause."""
    import sys

    from cli.launcher import Stack
    from cli.stack_config import StackConfig
    from cli.stack_failure import StackError

    stack = Stack(StackConfig(state_dir=tmp_path))
    stack.log_dir.mkdir(parents=True)
    alive = stack._spawn(
        "verifier", [sys.executable, "-c", "import time; time.sleep(60)"], {}, None
    )
    dying = stack._spawn(
        "learner",
        [
            sys.executable,
            "-c",
            "import sys; print('torch.OutOfMemoryError: CUDA out of memory'); sys.exit(3)",
        ],
        {},
        None,
    )
    try:
        dying.popen.wait(30)
        with pytest.raises(StackError) as caught:
            stack.raise_if_exited()
        assert str(caught.value) == (
            f"learner exited with status 3 while the job ran: oom; see {tmp_path}/logs/learner.log "
            "(last error: torch.OutOfMemoryError: CUDA out of memory)"
        )
        stack.procs.remove(dying)
        stack.raise_if_exited()  # the one left runs: nothing to say
    finally:
        alive.popen.kill()
        alive.popen.wait()
