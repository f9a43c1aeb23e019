"""The options of `shellrl eval`, `shellrl submit` and `shellrl show` as typed models (the
`Options` of cli/options.py), and `MODELS`: every command that has one (those of `down`, `status`,
`export`, `pass-rates`, `report` and `experiment`: cli/tool_options.py).

One definition gives each command's flags and --help (`add_options`) and its environment
`SHELLRL_CLI_<COMMAND>_<FIELD>` (e.g. SHELLRL_CLI_EVAL_EPISODES): a command of its own name in the
variable, because the same word means another thing to `run` and `up` (`temperature`: the
training's sampling temperature there, the evaluation's here; `state_dir`, deleted first by
`eval --model-path`; `model_path`: `eval` without one evaluates the running stack). A flag beats
the environment, which beats the field's default; these commands read no `--config` file (a
shellrl.toml's top level holds `run` and `up` options these would refuse). A `None` default
falls back to the environment variable its help names (`fallback_env`: applied by
cli/option_values.py's `resolve`, or by the command for the token and the gateway's URL).
Positional arguments (show's ID, submit's FILE) stay plain argparse arguments.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic_settings import SettingsConfigDict

from cli.options import ENV_PREFIX, Options, RunOptions, Switch, UpOptions, option
from cli.stack_config import STATE_DIR, default_ports_text
from cli.tool_options import (
    DownOptions,
    ExperimentOptions,
    ExportOptions,
    PassRatesOptions,
    ReportOptions,
    StatusOptions,
)

EVAL_SETS = ("eval_id", "eval_ood", "seeds", "agentbench")


class EvalOptions(Options):
    """`shellrl eval`."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX + "EVAL_")
    fallback_env: ClassVar[dict[str, str]] = {"url": "SHELLRL_ROLLOUT_URL"}

    url: str | None = option(
        None,
        "rollout gateway base URL (None: SHELLRL_ROLLOUT_URL, else http://127.0.0.1 on port "
        "8100 + --port-offset)",
    )
    sets: str = option(",".join(EVAL_SETS), f"comma-separated eval sets of {', '.join(EVAL_SETS)}")
    tasks: Path | None = option(None, "evaluate this JSONL task file instead")
    episodes: int = option(4, "episodes per task when T > 0")
    temperature: float = option(0.0, "0: greedy, 1 episode")
    out: Path | None = option(None, "write the evaluations' JSON views here")
    model_path: str | None = option(
        None,
        "start a stack on this model (smollm2, tiny, or a Hugging Face directory) and evaluate "
        "it; None: the running stack at --url",
    )
    state_dir: str = option(
        ".shellrl-eval",
        "with --model-path: the started stack's state (deleted first); without it, a stack whose "
        "<state-dir>/api_token is sent when that file exists (after SHELLRL_API_TOKEN, "
        "SHELLRL_API_TOKEN_FILE; else .shellrl/api_token)",
    )
    device: Literal["cpu", "cuda"] = option("cpu", "with --model-path: where the engine runs")
    port_offset: int = option(
        0,
        "move every port of the stack by N, so that a second stack can run beside the first "
        f"(with a --state-dir of its own); the default ports: {default_ports_text()}",
        metavar="N",
    )


GATEWAY_URL_HELP = (
    "rollout gateway base URL (None: SHELLRL_ROLLOUT_URL, else the rollout of the stack running "
    "from --state-dir, else port 8100)"
)
STATE_DIR_HELP = (
    "the local stack whose <state-dir>/api_token is sent (after SHELLRL_API_TOKEN, "
    "SHELLRL_API_TOKEN_FILE)"
)


class SubmitOptions(Options):
    """`shellrl submit FILE` (the file: a positional argument, cli/submit.py)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX + "SUBMIT_")

    url: str | None = option(None, GATEWAY_URL_HELP)
    batch_size: int = option(500, "tasks per request")
    split: Literal["train", "eval_id", "eval_ood", "eval"] | None = option(
        None, "split for lines that do not name one (the gateway's default is train)"
    )
    timeout_s: float = option(60.0, "HTTP timeout per request")
    quiet: Switch = option(False, "print only errors and the summary")
    state_dir: str = option(str(STATE_DIR), STATE_DIR_HELP)


class ShowOptions(Options):
    """`shellrl show ID` (the id: a positional argument, cli/commands/show.py)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX + "SHOW_")

    url: str | None = option(None, GATEWAY_URL_HELP)
    as_json: Switch = option(False, "print the gateway's JSON as it is", flag="--json")
    tokens: Switch = option(False, "also print every segment's token ids")
    timeout_s: float = option(30.0, "HTTP timeout")
    state_dir: str = option(str(STATE_DIR), STATE_DIR_HELP)


# every command with a typed options model, in docs/config.md's order
MODELS: dict[str, type[Options]] = {
    "up": UpOptions,
    "run": RunOptions,
    "eval": EvalOptions,
    "submit": SubmitOptions,
    "show": ShowOptions,
    "down": DownOptions,
    "status": StatusOptions,
    "export": ExportOptions,
    "pass-rates": PassRatesOptions,
    "report": ReportOptions,
    "experiment": ExperimentOptions,
}
