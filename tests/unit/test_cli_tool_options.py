"""The typed options of `shellrl down`, `status`, `export`, `pass-rates`, `report` and
`experiment` (issue 34 item 4, cli/tool_options.py): each command's flags and --help come from its
model with the flag names, defaults, choices and positionals it had when they were declared by
hand; its environment is SHELLRL_CLI_<COMMAND>_<OPTION> (a flag beats it); a bad value is refused,
naming the variable, with exit status 2 before the command does anything."""

from __future__ import annotations

import argparse
import os

import pytest

from cli.command_options import MODELS
from cli.main import build_parser, main, parse
from cli.tool_options import (
    DownOptions,
    ExperimentOptions,
    ExportOptions,
    PassRatesOptions,
    ReportOptions,
    StatusOptions,
)

TOOL_MODELS = {
    "down": DownOptions,
    "status": StatusOptions,
    "export": ExportOptions,
    "pass-rates": PassRatesOptions,
    "report": ReportOptions,
    "experiment": ExperimentOptions,
}
# the arguments each command needs besides its options
ARGV = {
    "down": [],
    "status": [],
    "export": ["ckpt", "out"],
    "pass-rates": [],
    "report": ["--compare", "a", "b"],
    "experiment": ["all"],
}
# every flag as argparse declared it by hand before the models (git show 48ac6a2:cli/commands/…):
# (flag, default, choices, nargs, type)
FLAGS_BEFORE = {
    "down": [
        ("--state-dir", ".shellrl", None, None, None),
        ("--timeout-s", 90.0, None, None, float),
    ],
    "status": [("--state-dir", ".shellrl", None, None, None), ("--watch", False, None, 0, None)],
    "export": [
        ("--dtype", None, ("float32", "bfloat16", "float16"), None, None),
        ("--tokenizer-from", None, None, None, None),
    ],
    "pass-rates": [
        ("--model-path", "smollm2", None, None, None),
        ("--state-dir", ".shellrl-pass-rates", None, None, None),
        ("--rollout-url", None, None, None, None),
        ("--tasks-per-template", 4, None, None, int),
        ("--episodes-per-task", 4, None, None, int),
        ("--temperature", 1.0, None, None, float),
        ("--max-new-tokens", 40, None, None, int),
        ("--max-turns", 2, None, None, int),
        ("--engine-threads", 2, None, None, int),
        ("--templates", "", None, None, None),
        ("--out", "", None, None, None),
    ],
    "report": [
        ("--compare", None, None, "+", None),
        ("--out", ".shellrl/compare", None, None, None),
    ],
    "experiment": [
        ("--quick", False, None, 0, None),
        ("--window-s", None, None, None, float),
        ("--scale", None, None, None, float),
        ("--levels", None, None, "+", int),
        ("--ks", None, None, "+", int),
        ("--model-path", "tiny", None, None, None),
        ("--device", "cpu", ("cpu", "cuda"), None, None),
        ("--threads", 1, None, None, int),
        ("--state-dir", ".shellrl", None, None, None),
    ],
}


def subparser(command: str) -> argparse.ArgumentParser:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[command]


def test_every_command_with_a_model_is_in_models():
    assert {c: MODELS[c] for c in TOOL_MODELS} == TOOL_MODELS


@pytest.mark.parametrize("command, model", TOOL_MODELS.items())
def test_every_field_is_a_flag_with_the_models_help_and_default(command, model):
    parser = subparser(command)
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    assert set(actions) - {"compare"} == set(model.model_fields)
    for name, info in model.model_fields.items():
        assert actions[name].help == f"{info.description} (default: {info.default})"
    text = "".join(parser.format_help().split())  # argparse wraps lines, also at hyphens
    for info in model.model_fields.values():
        assert "".join(f"{info.description} (default: {info.default})".split()) in text


@pytest.mark.parametrize("command", FLAGS_BEFORE)
def test_the_flags_keep_their_names_defaults_choices_and_types(command, monkeypatch):
    for name in [v for v in os.environ if v.startswith("SHELLRL_CLI_")]:
        monkeypatch.delenv(name)
    parser = subparser(command)
    actions = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    args = vars(parse([command, *ARGV[command]]))
    got = [
        (a.option_strings[0], args[a.dest] if a.dest != "compare" else a.default)
        + (a.choices, a.nargs, a.type)
        for a in actions
    ]
    assert got == FLAGS_BEFORE[command]
    assert [type(args[a.dest]) for a in actions if a.dest != "compare"] == [
        type(default) for flag, default, *_ in FLAGS_BEFORE[command] if flag != "--compare"
    ]


def test_positionals_and_reports_compare_stay_argparse_arguments():
    positionals = {
        c: [(a.dest, a.choices) for a in subparser(c)._actions if not a.option_strings]
        for c in ("export", "experiment")
    }
    assert positionals == {
        "export": [("checkpoint", None), ("out", None)],
        "experiment": [("name", ("concurrency", "long-tail", "staleness", "all"))],
    }
    [compare] = [a for a in subparser("report")._actions if a.dest == "compare"]
    assert (compare.required, compare.nargs, compare.metavar) == (True, "+", "DIR")
    args = parse(["export", "c", "o", "--dtype", "bfloat16", "--tokenizer-from", "tiny"])
    assert (args.checkpoint, args.out, args.dtype, args.tokenizer_from) == (
        "c",
        "o",
        "bfloat16",
        "tiny",
    )
    args = parse(["experiment", "staleness", "--quick", "--ks", "1", "2", "--window-s", "5"])
    assert (args.name, args.quick, args.ks, args.window_s, args.levels) == (
        "staleness",
        True,
        [1, 2],
        5.0,
        None,
    )
    assert parse(["report", "--compare", "a", "b", "--out", "x"]).compare == ["a", "b"]


def test_a_flag_beats_the_commands_variable_which_beats_the_default(monkeypatch):
    monkeypatch.setenv("SHELLRL_CLI_STATUS_WATCH", "true")
    monkeypatch.setenv("SHELLRL_CLI_DOWN_TIMEOUT_S", "5")
    monkeypatch.setenv("SHELLRL_CLI_PASS_RATES_TEMPERATURE", "0.5")
    monkeypatch.setenv("SHELLRL_CLI_EXPORT_DTYPE", "float16")
    monkeypatch.setenv("SHELLRL_CLI_REPORT_OUT", "cmp")
    monkeypatch.setenv("SHELLRL_CLI_EXPERIMENT_LEVELS", "1, 4 8")
    assert parse(["status"]).watch is True
    assert parse(["down"]).timeout_s == 5.0
    assert parse(["down", "--timeout-s", "7"]).timeout_s == 7.0
    assert parse(["pass-rates"]).temperature == 0.5
    assert parse(["pass-rates", "--temperature", "1"]).temperature == 1.0
    assert parse(["export", "c", "o"]).dtype == "float16"
    assert parse(["report", "--compare", "a"]).out == "cmp"
    assert parse(["experiment", "all"]).levels == [1, 4, 8]
    assert parse(["experiment", "all", "--levels", "2"]).levels == [2]
    # one command's variable is not another's: `down`'s and `pass-rates`' state_dir stay theirs
    monkeypatch.setenv("SHELLRL_CLI_STATUS_STATE_DIR", "elsewhere")
    assert (parse(["down"]).state_dir, parse(["status"]).state_dir) == (".shellrl", "elsewhere")


@pytest.mark.parametrize(
    "argv, variable, value, message",
    [
        (["down"], "SHELLRL_CLI_DOWN_TIMEOUT_S", "soon", "expected float, got 'soon'"),
        (["status"], "SHELLRL_CLI_STATUS_WATCH", "maybe", "expected true or false, got 'maybe'"),
        (["export", "c", "o"], "SHELLRL_CLI_EXPORT_DTYPE", "int8", "'int8' is not one of"),
        (["pass-rates"], "SHELLRL_CLI_PASS_RATES_MAX_TURNS", "two", "expected int, got 'two'"),
        (["report", "--compare", "a"], "SHELLRL_CLI_REPORT_OUTDIR", "x", "no option of"),
        (["experiment", "all"], "SHELLRL_CLI_EXPERIMENT_LEVELS", "1 x", "expected int, got 'x'"),
        (["experiment", "all"], "SHELLRL_CLI_EXPERIMENT_DEVICE", "gpu", "'gpu' is not one of"),
    ],
)
def test_a_bad_variable_is_one_line_with_status_2_before_the_command_runs(
    monkeypatch, capsys, tmp_path, argv, variable, value, message
):
    # had the command run: `down`/`status` would report no stack in tmp_path, `export` and
    # `report` a missing directory, `pass-rates` an unreachable gateway, `experiment` a missing
    # model; none of them writes under tmp_path/out
    extra = {
        "down": ["--state-dir", str(tmp_path)],
        "status": ["--state-dir", str(tmp_path)],
        "pass-rates": ["--rollout-url", "http://127.0.0.1:9", "--out", str(tmp_path / "out")],
        "report": ["--out", str(tmp_path / "out")],
        "experiment": ["--model-path", str(tmp_path / "none"), "--state-dir", str(tmp_path)],
    }.get(argv[0], [])
    if argv[0] == "export":
        argv = ["export", str(tmp_path / "ckpt"), str(tmp_path / "out")]
    monkeypatch.setenv(variable, value)
    assert main([*argv, *extra]) == 2
    out, err = capsys.readouterr()
    [line] = err.strip().splitlines()
    assert line.startswith(f"shellrl {argv[0]}: error: {variable}: {message}"), line
    assert out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["down", "--timeout-s", "soon"], "argument --timeout-s: invalid float value: 'soon'"),
        (["export", "c", "o", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
        (["pass-rates", "--max-turns", "two"], "argument --max-turns: invalid int value: 'two'"),
        (["experiment", "all", "--levels", "x"], "argument --levels: invalid int value: 'x'"),
        (["experiment", "all", "--window-s", "x"], "argument --window-s: invalid float value"),
        (["experiment", "every"], "argument name: invalid choice: 'every'"),
        (["report"], "the following arguments are required: --compare"),
        (["export", "c"], "the following arguments are required: out"),
    ],
)
def test_a_bad_flag_or_a_missing_argument_is_argparses_error_with_status_2(capsys, argv, message):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"shellrl {argv[0]}: error: {message}" in err, err
