"""The options of `shellrl up` and `shellrl run` as typed models (pydantic-settings), one per command.

One definition gives the command line (`add_options`: a `--kebab-case` flag per field, its help
text and default from the field, `--help` from the model), the keys of a `--config` TOML file and
the environment `SHELLRL_CLI_<FIELD>`. A value comes from, highest first: the flag, the
environment, the config file (its top level, then the command's own table, e.g. [run]), the
field's default. `resolve` (cli/option_values.py) builds the model from all of them before
anything starts; a value any of them gets wrong (type, choice, unknown key) is a CliError of one
line naming where it came from: `--steps`, `SHELLRL_CLI_STEPS` or `config file shellrl.toml:
steps`. The file's [env] table
(services' `SHELLRL_*` settings, each checked by the Settings class of the services that read it)
is cli/config_file.py's. The models of the other commands (on this base, with no file) are
cli/command_options.py's (`eval`, `submit`, `show`) and cli/tool_options.py's (`down`, `status`,
`export`, `pass-rates`, `report`, `experiment`); docs/config.md lists every model's options
(cli/config_doc.py).
"""

from __future__ import annotations

import argparse
import types
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BeforeValidator, Field
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from cli.job_config import JobConfig
from cli.recipe import Recipe
from cli.stack_config import DEFAULT_PORTS, GPU_MEMORY_FRACTIONS
from shellrl.tracking import BACKENDS

ENV_PREFIX = "SHELLRL_CLI_"


def _switch(value: Any) -> Any:
    """A switch is true or false: a bool (a flag, TOML), or 'true'/'false' (the environment)."""
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


Switch = Annotated[bool, BeforeValidator(_switch)]


def option(default: Any = None, help: str = "", **extra: Any) -> Any:
    """A field of an options model: its default, its help text; extra: `metavar`, `flag` (an
    inverted switch's flag, e.g. '--no-require-command'), `file=False` (not a config-file key)."""
    return Field(default, description=help, json_schema_extra=extra or None)


def _ports_text() -> str:
    return ", ".join(f"{name} {port}" for name, port in DEFAULT_PORTS.items())


class Options(BaseSettings):
    """The base of every command's options model: flags > SHELLRL_CLI_* > the file > defaults."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid")
    # {field: the environment variable a None value falls back to (`resolve`)}
    fallback_env: ClassVar[dict[str, str]] = {}

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        return init_settings, env_settings, FileValues(settings_cls)


class FileValues(PydanticBaseSettingsSource):
    """The config file's values for the command (set by cli/option_values.py's `resolve` on the
    class, read once)."""

    values: dict[str, Any] = {}

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(FileValues.values)


class StackOptions(Options):
    """What every command that starts a stack takes: the model, the state directory, ports,
    devices, the tracker and the recipe (cli/recipe.py)."""

    config: str | None = option(
        None,
        "TOML file of these options and an [env] table (cli/options.py, cli/config_file.py); "
        "flags override it",
        metavar="FILE",
        file=False,
    )
    model_path: str = option(JobConfig.model_path, "smollm2, tiny, or a Hugging Face directory")
    state_dir: str = option(str(JobConfig.state_dir), "Redis AOF, logs, checkpoints, report")
    port_offset: int = option(
        0,
        "move every port of the stack by N, so that a second stack can run beside the first "
        f"(with a --state-dir of its own); the default ports: {_ports_text()}",
        metavar="N",
    )
    device: Literal["cpu", "cuda"] = option(
        "cpu",
        "where engine and learner run; cuda: on one GPU they share or two GPUs, one each "
        "(--gpu-layout; bf16 engine), each within its fraction of its GPU's memory (fails at "
        "once without a CUDA GPU)",
    )
    gpu_layout: Literal["auto", "colocated", "split"] = option(
        "auto",
        "with --device cuda: colocated (engine and learner share the first GPU), split (engine "
        "on the first GPU, learner on the second), auto (split when two or more GPUs are "
        "visible)",
    )
    engine_gpu_memory: float = option(
        GPU_MEMORY_FRACTIONS["engine"],
        "with --device cuda: fraction of its GPU's memory the engine may allocate",
        metavar="FRACTION",
    )
    learner_gpu_memory: float = option(
        GPU_MEMORY_FRACTIONS["learner"],
        "with --device cuda: fraction of its GPU's memory the learner may allocate",
        metavar="FRACTION",
    )
    tracker: Literal[BACKENDS] = option(  # type: ignore[valid-type]
        JobConfig.tracker,
        "experiment tracking of the learner's steps, sampled episodes and settings (and of "
        "`run`'s evaluations and options): auto = TensorBoard in <state-dir>/tracking when "
        "installed; W&B runs offline",
    )
    # the recipe (cli/recipe.py): its defaults are the main job's
    group_size: int = option(Recipe.group_size, "episodes per GRPO group")
    groups_per_step: int = option(Recipe.groups_per_step, "groups per learner step")
    max_staleness: int = option(
        Recipe.max_staleness, "policy versions a trajectory may lag the learner"
    )
    lr: float = option(Recipe.lr, "peak AdamW learning rate")
    kl_coef: float = option(Recipe.kl_coef, "k3 KL to the initial policy (0 = off)")
    temperature: float = option(Recipe.temperature, "sampling temperature of training")
    max_new_tokens: int = option(Recipe.max_new_tokens, "new tokens per turn")
    max_turns: int = option(Recipe.max_turns, "agent turns per episode")
    engine_threads: int = option(
        Recipe.engine_threads, "torch threads of the engine (0 = torch's default)"
    )
    learner_threads: int = option(
        Recipe.learner_threads, "torch threads of the learner (0 = torch's default)"
    )
    seed: int = option(
        Recipe.seed,
        "seed of the run: engine sampling (a seed per request), the pool's epoch order, the "
        "learner's RNGs",
    )
    dynamic_sampling: Switch = option(
        Recipe.dynamic_sampling,
        "DAPO dynamic sampling: every learner step trains groups with reward variance",
    )
    pass_rate_steering: Switch = option(
        Recipe.pass_rate_steering,
        "run fewer groups of templates whose recent training success is 0 or 1",
    )
    require_command: Switch = option(
        Recipe.require_command,
        "train on successes that ran no command too (guesses get amplified); the default is "
        "require_command",
        flag="--no-require-command",
    )


class UpOptions(StackOptions):
    """`shellrl up`."""

    quiet: Switch = option(False, "do not echo service logs (they stay in <state>/logs)")


class RunOptions(StackOptions):
    """`shellrl run`: the stack's options, the job's and --attach's."""

    fallback_env: ClassVar[dict[str, str]] = {"learner_url": "SHELLRL_LEARNER_URL"}

    time_budget_min: float = option(JobConfig.time_budget_s / 60, "training stops after this")
    steps: int = option(JobConfig.steps, "learner steps (policy versions)")
    train_set: str = option(
        JobConfig.train_set,
        "curriculum, contrast (the curriculum + counting tasks that differ only in the quantity "
        "asked), default, generated, a plug-in's task set, or a .jsonl",
    )
    eval_id_episodes: int = option(
        JobConfig.eval_id_episodes, "held-out instances of the training templates"
    )
    eval_ood_episodes: int = option(
        JobConfig.eval_ood_episodes, "instances of templates never trained on"
    )
    agentbench_eval_tasks: int = option(
        JobConfig.agentbench_eval_tasks, "AgentBench training tasks evaluated"
    )
    task_seed: int = option(
        JobConfig.task_seed,
        "seed of the generated training pool and eval sets (keep it to compare runs)",
    )
    eval_samples: int = option(
        JobConfig.eval_samples,
        "episodes per eval task (> 1 needs --eval-temperature > 0; estimator: mean pass rate "
        "per task, bootstrap interval over tasks)",
    )
    eval_temperature: float = option(
        JobConfig.eval_temperature,
        "sampling temperature of the evaluations (0 = greedy, one episode per task)",
    )
    eval_every_steps: int = option(
        JobConfig.eval_every_steps,
        "evaluate eval_id and eval_ood every N steps during training too, to date a template's "
        "loss (0 = off; each pauses the learner ~1-2 min on 2 cores, outside the time budget)",
    )
    eval_kl: Switch = option(
        JobConfig.eval_kl,
        "after each evaluation during and after training, the KL to the initial policy on its "
        "eval_id/eval_ood episodes per template (the paused learner scores them, ~1 min on CPU)",
    )
    fresh: Switch = option(False, "delete <state-dir> first (Redis, checkpoints, logs)")
    attach: str | None = option(
        None,
        "drive the stack running at this rollout gateway URL (compose, k8s) instead of "
        "starting one; the report goes to <state-dir>/report",
        metavar="URL",
    )
    learner_url: str | None = option(
        None,
        "with --attach: the learner (SHELLRL_LEARNER_URL, else the gateway's host, port 8103 + "
        "--port-offset)",
    )
    verifier_url: str | None = option(
        None, "with --attach: the verifier, to check its require_command (compose publishes none)"
    )
    token: str | None = option(
        None,
        "with --attach: the stack's bearer token (else SHELLRL_API_TOKEN, SHELLRL_API_TOKEN_FILE "
        "or <state-dir>/api_token)",
    )


def field_extra(info: FieldInfo) -> dict:
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def is_switch(info: FieldInfo) -> bool:
    return info.annotation is bool or any(a is bool for a in get_args(info.annotation))


def flag_of(name: str, info: FieldInfo) -> str:
    """The field's flag: its own `flag` (`--no-require-command`, `--json`), else --field-name."""
    return field_extra(info).get("flag", "--" + name.replace("_", "-"))


def is_inverted(name: str, info: FieldInfo) -> bool:
    """A switch whose flag turns it off: its own flag starts with --no-."""
    return is_switch(info) and flag_of(name, info).startswith("--no-")


def value_type(info: FieldInfo) -> Any:
    """The field's type without None (`float | None` -> float)."""
    kind = info.annotation
    if get_origin(kind) in (Union, types.UnionType):
        kind = next(a for a in get_args(kind) if a is not type(None))
    return kind


def choices_of(info: FieldInfo) -> tuple | None:
    """The values of a Literal field (None allowed or not), else None."""
    kind = value_type(info)
    return get_args(kind) if get_origin(kind) is Literal else None


def add_options(parser: argparse.ArgumentParser, model: type[Options]) -> None:
    """A flag per field of `model`, in field order: `--field-name` or the field's own `flag` (a
    switch turns the field on, or off when its flag starts with --no-), its choices, its type (an
    int or float, None allowed or not; a list of them: one or more values), its help with
    `(default: X)` (the flag's: False for an inverted switch whose field is on). Each flag's
    argparse default is SUPPRESS, so the parsed namespace holds only what was given (`resolve`)."""
    for name, info in model.model_fields.items():
        extra = field_extra(info)
        inverted = is_inverted(name, info)
        # an inverted switch's flag is off by default when its field is on (--no-require-command)
        shown = (not info.default) if inverted else info.default
        text = f"{info.description} (default: {shown})"
        kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": text}
        if is_switch(info):
            kw["action"] = "store_false" if inverted else "store_true"
        else:
            if "metavar" in extra:
                kw["metavar"] = extra["metavar"]
            if choices := choices_of(info):
                kw["choices"] = choices
            elif value_type(info) in (int, float):
                kw["type"] = value_type(info)
            elif get_origin(value_type(info)) is list:
                kw["nargs"], [kw["type"]] = "+", get_args(value_type(info))
        parser.add_argument(flag_of(name, info), **kw)
