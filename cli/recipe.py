"""The main job's recipe: the RL settings every stack the CLI starts runs with, in one place.

`shellrl run` (its JobConfig is a Recipe), `shellrl up` (so `POST /v1/runs` and `run --attach`
against it train as `shellrl run` does) and `shellrl eval --model-path` (the same turns and tokens
as the job's evaluations) all start the services with `Recipe.env` and `Recipe.service_env`, and
take the same options for it (cli/options.py's StackOptions: --lr, --kl-coef, --temperature,
...). A config file's [env] table may not set these names: the option sets them.
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


def recipe_from_args(args) -> Recipe:
    """The Recipe of parsed options (cli/options.py's StackOptions has its fields)."""
    return Recipe(**{f.name: getattr(args, f.name) for f in fields(Recipe)})
