"""The options of the commands around a stack, as typed models (the `Options` of cli/options.py,
as cli/command_options.py's): `shellrl down`, `status`, `export`, `pass-rates`, `report` and
`experiment`.

Each model gives its command's flags and --help (`add_options`) and its environment
`SHELLRL_CLI_<COMMAND>_<FIELD>` (e.g. SHELLRL_CLI_STATUS_WATCH, SHELLRL_CLI_PASS_RATES_TEMPERATURE:
the command's name, because `state_dir`, `model_path` or `temperature` mean another thing to each
command). A flag beats the environment, which beats the field's default; no `--config` file.
Positional arguments stay plain argparse arguments (export's CHECKPOINT and OUT, experiment's
NAME), and so does report's `--compare DIR [DIR ...]`: a required flag, which argparse refuses
when missing (an environment value for it could never be read).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator
from pydantic_settings import NoDecode, SettingsConfigDict

from cli.options import ENV_PREFIX, Options, Switch, option


def _int_list(value: Any) -> Any:
    """A list flag's value from the environment: numbers separated by spaces or commas ('1 4 8',
    '1,4,8'); a list (the flag's) as it is."""
    if isinstance(value, str):
        return [part for part in re.split(r"[\s,\[\]]+", value) if part]
    return value


# a flag of one or more ints (`--levels 1 4 8`); in the environment '1 4 8' or '1,4,8'
IntList = Annotated[list[int] | None, NoDecode, BeforeValidator(_int_list)]

STACK_STATE_HELP = "the stack's state directory (its stack.json)"


class DownOptions(Options):
    """`shellrl down`."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX + "DOWN_")

    state_dir: str = option(".shellrl", STACK_STATE_HELP)
    timeout_s: float = option(90.0, "seconds to wait for the stack to stop")


class StatusOptions(Options):
    """`shellrl status`."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX + "STATUS_")

    state_dir: str = option(".shellrl", STACK_STATE_HELP)
    watch: Switch = option(False, "refresh every 2 s until Ctrl-C")


class ExportOptions(Options):
    """`shellrl export CHECKPOINT OUT` (both positional arguments, cli/commands/export.py)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX + "EXPORT_")

    dtype: Literal["float32", "bfloat16", "float16"] | None = option(
        None, "cast the weights (None: the training dtype, as checkpointed)"
    )
    tokenizer_from: str | None = option(
        None,
        "base model (smollm2, tiny or a directory) whose tokenizer to copy when the checkpoint "
        "has none",
    )


class PassRatesOptions(Options):
    """`shellrl pass-rates`."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX + "PASS_RATES_")

    model_path: str = option("smollm2", "smollm2, tiny, or a Hugging Face directory")
    state_dir: str = option(".shellrl-pass-rates", "the stack's state (deleted first)")
    rollout_url: str | None = option(None, "use this running gateway instead of starting a stack")
    tasks_per_template: int = option(4, "task instances per template")
    episodes_per_task: int = option(4, "sampled episodes per task")
    temperature: float = option(1.0, "sampling temperature")
    max_new_tokens: int = option(40, "new tokens per turn")
    max_turns: int = option(2, "agent turns per episode")
    engine_threads: int = option(2, "torch threads of the engine")
    templates: str = option("", "comma-separated templates ('' = every train template)")
    out: str = option("", "'' = docs/runs/pass-rates/pass_rates_T<temperature>.json")


class ReportOptions(Options):
    """`shellrl report --compare DIR [DIR ...]` (--compare: a required argparse argument,
    cli/commands/report.py)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX + "REPORT_")

    out: str = option(".shellrl/compare", "where compare.json, .md and .png go")


class ExperimentOptions(Options):
    """`shellrl experiment NAME` (NAME: a positional argument, cli/commands/experiment.py)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX + "EXPERIMENT_")

    quick: Switch = option(False, "short windows and fewer points (make bench)")
    window_s: float | None = option(
        None, "measuring time per point (None: 25-30 s quick, 60-90 s full)"
    )
    scale: float | None = option(
        None,
        "episode durations are base seconds (10 s, 80 s) times this (default 0.1 on cpu, 1 on "
        "cuda)",
    )
    levels: IntList = option(None, "concurrency: environments per point")
    ks: IntList = option(None, "staleness: max_staleness per point")
    model_path: str = option("tiny", "tiny (default), smollm2 or a Hugging Face directory")
    device: Literal["cpu", "cuda"] = option("cpu", "where engine and learner run")
    threads: int = option(1, "torch threads of the engine and the learner")
    state_dir: str = option(".shellrl", "reports go to <state-dir>/experiments/<name>/")
