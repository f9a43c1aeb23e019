"""The typed options of `shellrl run` and `shellrl up` (issue 34 item 4, cli/options.py): one
pydantic-settings model per command gives the flags and --help, the config file's keys and the
environment SHELLRL_CLI_<OPTION>; flags beat the environment, which beats the file; a bad value
from any of them is one line naming where it came from, before anything starts."""

from __future__ import annotations

import pytest

from cli.errors import CliError
from cli.main import build_parser, parse
from cli.options import RunOptions, UpOptions


def write(tmp_path, text: str):
    path = tmp_path / "shellrl.toml"
    path.write_text(text)
    return path


def test_flags_beat_the_environment_which_beats_the_file(tmp_path, monkeypatch):
    path = str(write(tmp_path, "steps = 7\nlr = 1\nkl-coef = 0.2\n[run]\nmax_turns = 3\n"))
    monkeypatch.setenv("SHELLRL_CLI_STEPS", "8")
    monkeypatch.setenv("SHELLRL_CLI_DYNAMIC_SAMPLING", "true")
    args = parse(["run", "--config", path, "--lr", "0.5"])
    assert (args.steps, args.lr, args.kl_coef, args.max_turns) == (8, 0.5, 0.2, 3)
    assert args.dynamic_sampling is True and args.eval_samples == RunOptions().eval_samples
    assert parse(["run", "--config", path, "--steps", "9"]).steps == 9
    monkeypatch.delenv("SHELLRL_CLI_STEPS")
    assert parse(["run", "--config", path]).steps == 7


@pytest.mark.parametrize(
    "where, message",
    [
        ({"SHELLRL_CLI_STEPS": "many"}, "SHELLRL_CLI_STEPS: expected int, got 'many'"),
        ({"SHELLRL_CLI_DEVICE": "gpu"}, "SHELLRL_CLI_DEVICE: 'gpu' is not one of cpu, cuda"),
        ({"SHELLRL_CLI_FRESH": "maybe"}, "SHELLRL_CLI_FRESH: expected true or false"),
        # a mistyped name was ignored without a word
        (
            {"SHELLRL_CLI_STEPZ": "3"},
            "SHELLRL_CLI_STEPZ: no option of a `shellrl` command (up, run, eval, submit, show, "
            "down, status, export, pass-rates, report, experiment)",
        ),
        ("device = 'gpu'\n", "config file {path}: device: 'gpu' is not one of cpu, cuda"),
        ("tracker = 'comet'\n", "config file {path}: tracker: 'comet' is not one of auto"),
        ("train-set = 3\n", "config file {path}: train-set: expected a string, got 3"),
        ("lr = true\n", "config file {path}: lr: expected float, got True"),
        ("config = 'x.toml'\n", "config file {path}: unknown option 'config'"),
        (
            "no-require-command = 1\n",
            "config file {path}: no-require-command: expected true or false, got 1",
        ),
    ],
)
def test_a_bad_value_names_the_variable_or_the_file_key(tmp_path, monkeypatch, where, message):
    argv = ["run"]
    if isinstance(where, dict):
        for name, value in where.items():
            monkeypatch.setenv(name, value)
    else:
        path = write(tmp_path, where)
        argv += ["--config", str(path)]
        message = message.format(path=path)
    with pytest.raises(CliError) as caught:
        parse(argv)
    assert str(caught.value).startswith(message), str(caught.value)


@pytest.mark.parametrize(
    "argv, where, message",
    [
        (["run", "--group-size", "0"], {}, "--group-size: SHELLRL_GROUP_SIZE='0': rollout: "),
        (["up"], {"SHELLRL_CLI_MAX_TURNS": "100"}, "SHELLRL_CLI_MAX_TURNS: SHELLRL_MAX_TURNS="),
        (["run"], "temperature = -1\n", "config file {path}: temperature: SHELLRL_TEMPERATURE="),
        (["up"], "[up]\nlr = 0\n", "config file {path}: lr: SHELLRL_LR='0.0': learner: "),
    ],
)
def test_a_recipe_value_a_service_refuses_names_the_option_before_anything_starts(
    tmp_path, monkeypatch, argv, where, message
):
    # the services' Settings check the recipe's values at parse time (a file key of the right
    # name with a bad value used to start Redis, the engine, sandbox and verifier first, then
    # fail in the rollout's log naming only SHELLRL_GROUP_SIZE)
    assert parse(["run", "--group-size", "2", "--kl-coef", "0"]).group_size == 2
    if isinstance(where, dict):
        for name, value in where.items():
            monkeypatch.setenv(name, value)
    else:
        path = write(tmp_path, where)
        argv = [*argv, "--config", str(path)]
        message = message.format(path=path)
    with pytest.raises(CliError) as caught:
        parse(argv)
    assert str(caught.value).startswith(message), str(caught.value)


def test_one_commands_environment_option_is_ignored_by_the_other(monkeypatch):
    monkeypatch.setenv("SHELLRL_CLI_QUIET", "true")
    monkeypatch.setenv("SHELLRL_CLI_STEPS", "3")
    assert parse(["run"]).steps == 3 and parse(["up"]).quiet is True


def test_every_field_is_a_flag_with_its_help_and_default():
    [sub] = [a for a in build_parser()._actions if hasattr(a, "choices") and a.choices]
    for command, model in (("run", RunOptions), ("up", UpOptions)):
        actions = {a.dest: a for a in sub.choices[command]._actions if a.dest != "help"}
        assert set(actions) == set(model.model_fields), command
        for name, info in model.model_fields.items():
            assert info.description in actions[name].help
            inverted = actions[name].option_strings[0].startswith("--no-")
            shown = (not info.default) if inverted else info.default
            assert f"(default: {shown})" in actions[name].help
    # the flag is off unless given, as every other switch's (it read "(default: True)")
    assert (
        "(default: False)" in sub.choices["run"]._option_string_actions["--no-require-command"].help
    )
    assert parse(["up", "--no-require-command"]).require_command is False
    assert parse(["up"]).require_command is True and parse(["up"]).quiet is False


def test_docs_config_md_is_generated_from_the_models():
    from pathlib import Path

    from cli.config_doc import markdown

    assert (Path(__file__).parents[2] / "docs/config.md").read_text() == markdown(), (
        "regenerate: python -m cli.config_doc > docs/config.md"
    )
