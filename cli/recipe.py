"""The main job's recipe: the RL settings every stack the CLI starts runs with, in one place.

`shellrl run` (its JobConfig is a Recipe), `shellrl up` (so `POST /v1/runs` and `run --attach`
against it train as `shellrl run` does) and `shellrl eval --model-path` (the same turns and tokens
as the job's evaluations) all start the services with `Recipe.env` and `Recipe.service_env`, and
take the same options for it (`add_recipe_arguments`: --lr, --kl-coef, --temperature, ...). A
config file's [env] table may not set these names (`managed_names`): the option sets them.
docker-compose.yml and deploy/k8s set the same values (tests/service/test_deploy_agreement.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class Recipe:
    """The settings of one training recipe; each field is the option of its name."""

    group_size: int = 8
    groups_per_step: int = 4
    max_staleness: int = 1
    lr: float = 2e-5
    # k3 KL to the initial policy (the learner's SHELLRL_KL_COEF). Without it run7 learned word_count
    # and lost count_lines (4/10 -> 0/10; its counting answers looked like word counts); runs 8 and
    # 9 with 0.1 met the target, learning count_lines with word_count or cat_file (BENCHMARKS.md,
    # "Main job")
    kl_coef: float = 0.1
    # T = 0.7 (learner and engine alike, pitfall C07): at T = 1 the base policy solved 2 of 276
    # pass-rate episodes, at 0.7 6 of 143 (docs/runs/pass-rates/pass_rates_T*.json), so more groups
    # carry a reward variance
    temperature: float = 0.7
    max_new_tokens: int = 40
    max_turns: int = 2
    # torch intra-op threads of the engine and the learner. The learner (1 thread; prefix sharing
    # makes a trained group ~30 s) idles most of the time, so the engine gets both cores: in
    # BENCHMARKS.md's "Main job", run3 (engine 2 threads) trained 13 groups in 17 min, run2 (1) 6
    engine_threads: int = 2
    learner_threads: int = 1
    # drives the engine's per-request sampling seeds, the pool's epoch order and pass-rate
    # steering's draws (rollout), and the learner's torch/numpy/python RNGs
    seed: int = 0
    # DAPO dynamic sampling (gateway and learner): a step trains groups_per_step groups with
    # reward variance; groups whose members all scored the same give their admission back
    dynamic_sampling: bool = False
    # pass over most tasks of templates whose recent training success is 0 or 1 (rollout)
    pass_rate_steering: bool = False
    # a success without any command trains as 0 (services/verifier/rewards.py, ungrounded_success):
    # run6 collapsed into answering at once, rewarded by lucky guesses; eval success is the plain
    # outcome
    require_command: bool = True

    def env(self) -> dict[str, str]:
        """SHELLRL_* settings of every service."""
        return {
            "SHELLRL_GROUP_SIZE": str(self.group_size),
            "SHELLRL_GROUPS_PER_STEP": str(self.groups_per_step),
            "SHELLRL_MAX_STALENESS": str(self.max_staleness),
            "SHELLRL_LR": str(self.lr),
            "SHELLRL_TEMPERATURE": str(self.temperature),
            "SHELLRL_MAX_NEW_TOKENS": str(self.max_new_tokens),
            "SHELLRL_MAX_TURNS": str(self.max_turns),
            "SHELLRL_DYNAMIC_SAMPLING": str(self.dynamic_sampling).lower(),
        }

    def service_env(self) -> dict[str, dict[str, str]]:
        """SHELLRL_* settings of one service each."""
        return {
            "engine": {"SHELLRL_NUM_THREADS": str(self.engine_threads)},
            "verifier": {"SHELLRL_REQUIRE_COMMAND": str(self.require_command).lower()},
            "rollout": {
                "SHELLRL_POOL_SEED": str(self.seed),
                "SHELLRL_SAMPLING_SEED": str(self.seed),
                "SHELLRL_PASS_RATE_STEERING": str(self.pass_rate_steering).lower(),
            },
            # a whole group per micro-batch, its prompt run once (prefix sharing needs the
            # KV cache, so no activation checkpointing; 135M parameters fit in memory anyway)
            "learner": {
                "SHELLRL_NUM_THREADS": str(self.learner_threads),
                "SHELLRL_SEED": str(self.seed),
                "SHELLRL_KL_COEF": str(self.kl_coef),
                "SHELLRL_MICRO_BATCH_SIZE": str(self.group_size),
                "SHELLRL_GRADIENT_CHECKPOINTING": "false",
                "SHELLRL_SHARE_PREFIX_MIN_TOKENS": "32",
            },
        }

    def recipe(self) -> Recipe:
        """This recipe alone (a JobConfig's, without the job's other options)."""
        return Recipe(**{f.name: getattr(self, f.name) for f in fields(Recipe)})


# The options that set the Recipe field of their name, in --help's order: (field, type, help).
# Each shows the field's default; a `bool` is a switch that turns it on (require_command: off).
RECIPE_OPTIONS = (
    ("group_size", int, "episodes per GRPO group"),
    ("groups_per_step", int, "groups per learner step"),
    ("max_staleness", int, "policy versions a trajectory may lag the learner"),
    ("lr", float, "peak AdamW learning rate"),
    ("kl_coef", float, "k3 KL to the initial policy (0 = off)"),
    ("temperature", float, "sampling temperature of training"),
    ("max_new_tokens", int, "new tokens per turn"),
    ("max_turns", int, "agent turns per episode"),
    ("engine_threads", int, "torch threads of the engine (0 = torch's default)"),
    ("learner_threads", int, "torch threads of the learner (0 = torch's default)"),
    (
        "seed",
        int,
        "seed of the run: engine sampling (a seed per request), the pool's epoch order, "
        "the learner's RNGs",
    ),
    (
        "dynamic_sampling",
        bool,
        "DAPO dynamic sampling: every learner step trains groups with reward variance",
    ),
    (
        "pass_rate_steering",
        bool,
        "run fewer groups of templates whose recent training success is 0 or 1",
    ),
)


def add_recipe_arguments(parser) -> None:
    """--group-size, --lr, --kl-coef, --temperature, ... (RECIPE_OPTIONS) and
    --no-require-command, each with the main job's default."""
    d = Recipe()
    for name, kind, help_text in RECIPE_OPTIONS:
        flag, default = "--" + name.replace("_", "-"), getattr(d, name)
        if kind is bool:
            parser.add_argument(flag, action="store_true", default=default, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=help_text)
    parser.add_argument(
        "--no-require-command",
        dest="require_command",
        action="store_false",
        help="train on successes that ran no command too (guesses get amplified); "
        "the default is require_command",
    )


def recipe_from_args(args) -> Recipe:
    """The Recipe of parsed options (add_recipe_arguments)."""
    return Recipe(**{f.name: getattr(args, f.name) for f in fields(Recipe)})


def managed_names(recipe: Recipe) -> set[str]:
    """The SHELLRL_* names the recipe sets (a config file's [env] table may not)."""
    return set(recipe.env()) | {n for env in recipe.service_env().values() for n in env}
