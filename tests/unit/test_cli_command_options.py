"""The typed options of `shellrl eval`, `submit` and `show` (issue 34 item 4,
cli/command_options.py): each command's flags and --help come from its model, as `run`'s and
`up`'s do; its environment is SHELLRL_CLI_<COMMAND>_<OPTION> (a flag beats it); a bad value is
refused, naming the flag or the variable, with exit status 2 before anything is sent."""

from __future__ import annotations

import argparse

import pytest

from cli.command_options import MODELS, EvalOptions, ShowOptions, SubmitOptions
from cli.main import build_parser, main, parse

COMMANDS = {"eval": [], "submit": ["tasks.jsonl"], "show": ["some-id"]}


def subparser(command: str) -> argparse.ArgumentParser:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[command]


@pytest.mark.parametrize(
    "command, model", [("eval", EvalOptions), ("submit", SubmitOptions), ("show", ShowOptions)]
)
def test_every_field_is_a_flag_with_the_models_help_and_default(command, model):
    parser = subparser(command)
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    assert set(actions) == set(model.model_fields)
    for name, info in model.model_fields.items():
        assert actions[name].help == f"{info.description} (default: {info.default})"
    text = "".join(parser.format_help().split())  # argparse wraps lines, also at hyphens
    for info in model.model_fields.values():
        assert "".join(f"{info.description} (default: {info.default})".split()) in text


def test_the_flags_keep_their_names_defaults_and_positionals(monkeypatch, tmp_path):
    monkeypatch.delenv("SHELLRL_ROLLOUT_URL", raising=False)
    args = parse(["eval"])
    assert (args.url, args.sets, args.episodes, args.temperature) == (
        None,
        "eval_id,eval_ood,seeds,agentbench",
        4,
        0.0,
    )
    assert (args.state_dir, args.device, args.port_offset, args.tasks) == (
        ".shellrl-eval",
        "cpu",
        0,
        None,
    )
    args = parse(["eval", "--tasks", "t.jsonl", "--out", str(tmp_path / "r.json")])
    assert args.tasks.name == "t.jsonl" and args.out == tmp_path / "r.json"
    args = parse(["submit", "t.jsonl", "--batch-size", "7", "--split", "eval", "--quiet"])
    assert (args.file.name, args.batch_size, args.split, args.quiet) == ("t.jsonl", 7, "eval", True)
    assert (args.timeout_s, parse(["submit", "-"]).split) == (60.0, None)
    args = parse(["show", "traj-1", "--json", "--tokens", "--timeout-s", "5"])
    assert (args.trajectory_id, args.as_json, args.tokens, args.timeout_s) == (
        "traj-1",
        True,
        True,
        5.0,
    )
    assert parse(["show", "traj-1"]).as_json is False


def test_a_flag_beats_the_commands_variable_which_beats_the_default(monkeypatch):
    monkeypatch.setenv("SHELLRL_CLI_EVAL_EPISODES", "2")
    monkeypatch.setenv("SHELLRL_CLI_SUBMIT_QUIET", "true")
    monkeypatch.setenv("SHELLRL_CLI_SHOW_AS_JSON", "true")
    assert parse(["eval"]).episodes == 2 and parse(["eval", "--episodes", "3"]).episodes == 3
    assert parse(["submit", "t.jsonl"]).quiet is True
    assert parse(["show", "x"]).as_json is True


def test_evals_gateway_url_falls_back_to_shellrl_rollout_url(monkeypatch):
    monkeypatch.setenv("SHELLRL_ROLLOUT_URL", "http://gw:8100")
    assert parse(["eval"]).url == "http://gw:8100"
    assert parse(["eval", "--url", "http://given:1"]).url == "http://given:1"
    monkeypatch.setenv("SHELLRL_CLI_EVAL_URL", "http://env:2")
    assert parse(["eval"]).url == "http://env:2"


def test_run_and_ups_variables_and_config_file_do_not_reach_these_commands(monkeypatch, tmp_path):
    # the same word means another thing to `run`: the training's temperature, its state (which
    # `eval --model-path` would delete), a model (`eval` without one evaluates the running stack)
    path = tmp_path / "shellrl.toml"
    path.write_text("group-size = 4\n[run]\nsteps = 3\n")
    for name, value in {
        "SHELLRL_CLI_TEMPERATURE": "1.0",
        "SHELLRL_CLI_STATE_DIR": str(tmp_path / "training"),
        "SHELLRL_CLI_MODEL_PATH": "tiny",
        "SHELLRL_CLI_QUIET": "true",
        "SHELLRL_CLI_CONFIG": str(path),
    }.items():
        monkeypatch.setenv(name, value)
    args = parse(["eval"])
    assert (args.temperature, args.state_dir, args.model_path) == (0.0, ".shellrl-eval", None)
    assert parse(["submit", "t.jsonl"]).quiet is False and parse(["show", "x"]).as_json is False
    assert parse(["run"]).steps == 3 and parse(["up"]).quiet is True


def test_one_variable_is_read_by_two_commands_only_where_it_means_one_thing():
    readers: dict[str, set[str]] = {}
    for command, model in MODELS.items():
        for name in model.model_fields:
            variable = model.model_config["env_prefix"] + name.upper()
            readers.setdefault(variable, set()).add(name)
    shared = {v for v, names in readers.items() if len(names) > 1}
    # the evaluations' sampling temperature: `eval --temperature`, `run --eval-temperature`
    assert shared == {"SHELLRL_CLI_EVAL_TEMPERATURE"}


@pytest.mark.parametrize(
    "argv, variable, value, message",
    [
        (["eval"], "SHELLRL_CLI_EVAL_EPISODES", "x", "SHELLRL_CLI_EVAL_EPISODES: expected int"),
        (["eval"], "SHELLRL_CLI_EVAL_DEVICE", "gpu", "SHELLRL_CLI_EVAL_DEVICE: 'gpu' is not one"),
        (["eval"], "SHELLRL_CLI_EVAL_TEMPERATURE", "hot", "SHELLRL_CLI_EVAL_TEMPERATURE: expected"),
        (
            ["submit", "t.jsonl"],
            "SHELLRL_CLI_SUBMIT_BATCH_SIZE",
            "many",
            "SHELLRL_CLI_SUBMIT_BATCH_SIZE: expected int, got 'many'",
        ),
        (
            ["submit", "t.jsonl"],
            "SHELLRL_CLI_SUBMIT_SPLIT",
            "test",
            "SHELLRL_CLI_SUBMIT_SPLIT: 'test' is not one of train, eval_id, eval_ood, eval",
        ),
        (["show", "x"], "SHELLRL_CLI_SHOW_AS_JSON", "maybe", "SHELLRL_CLI_SHOW_AS_JSON: expected"),
        (["show", "x"], "SHELLRL_CLI_SHOW_TIMEOUT_S", "soon", "SHELLRL_CLI_SHOW_TIMEOUT_S: expect"),
        (["show", "x"], "SHELLRL_CLI_SHOW_JSON", "true", "SHELLRL_CLI_SHOW_JSON: no option of"),
    ],
)
def test_a_bad_variable_is_one_line_with_status_2_before_anything_is_sent(
    monkeypatch, capsys, argv, variable, value, message
):
    # a port nothing listens on: a request would end in "cannot reach", not in this line
    monkeypatch.setenv(variable, value)
    assert main([*argv, "--url", "http://127.0.0.1:9"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"shellrl {argv[0]}: error: {message}"), line


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "--episodes", "x"], "argument --episodes: invalid int value: 'x'"),
        (["eval", "--device", "gpu"], "argument --device: invalid choice: 'gpu'"),
        (["submit", "t.jsonl", "--batch-size", "x"], "argument --batch-size: invalid int value"),
        (["submit", "t.jsonl", "--split", "test"], "argument --split: invalid choice: 'test'"),
        (["show", "x", "--timeout-s", "soon"], "argument --timeout-s: invalid float value"),
        (["run", "--steps", "x"], "argument --steps: invalid int value: 'x'"),  # as run's
    ],
)
def test_a_bad_flag_names_the_flag_with_status_2_as_runs_does(capsys, argv, message):
    with pytest.raises(SystemExit) as done:
        main([*argv, "--url", "http://127.0.0.1:9"] if argv[0] != "run" else argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"shellrl {argv[0]}: error: {message}" in err, err
