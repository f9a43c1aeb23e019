"""The task sets of the main job (`shellrl run`, cli/main_job.py; `shellrl run --attach`,
cli/attached_job.py; `shellrl eval`): what it trains on (`train_tasks`: the curriculum by default)
and the held-out sets it evaluates before and after (`eval_sets`).
"""

from __future__ import annotations

from typing import Protocol


class TaskChoice(Protocol):
    """The settings of a job that choose its tasks (`cli.job_config.JobConfig` has them)."""

    train_set: str
    task_seed: int
    eval_id_episodes: int
    eval_ood_episodes: int
    agentbench_eval_tasks: int


# The curriculum: generated templates the policy can learn from. Measured with `shellrl pass-rates`
# (docs/runs/pass-rates/pass_rates_T1.0.json, _T0.7.json: 12 episodes per template; 2 of 23 templates had a
# success at T = 1, 4 of 12 at T = 0.7) and from the training runs in BENCHMARKS.md ("Main job"):
# cat_file and word_count show 0/12 in the pass-rate files but were learned from rare successes
# (run1: word_count 0 -> 8/8, run3: cat_file 0 -> 7/8), so they stay; grep_count and json_field had
# no success in either pass-rate measurement nor in any before/after evaluation of runs 1-3, so they
# are out. `--train-set default` trains on everything (seeds + all generated train templates +
# AgentBench); `--train-set contrast` on the curriculum plus contrast sets (CURRICULUM_SETS).
CURRICULUM_TEMPLATES = (
    "count_matching_users",
    "count_lines",
    "make_executable",
    "cat_file",
    "line_n",
    "word_count",
    "count_unique",
)


CURRICULUM_SETS = ("curriculum", "contrast")
"""`--train-set` values built on the curriculum: their eval_id is the curriculum templates' (the
same eval set, so `contrast` compares with the default run for run). `contrast` adds the contrast
sets of tasksets/contrast.py (48 counting tasks, 4 quantities of each of 12 files) to the
curriculum's pool (issue 33 item 2)."""


def _eval_id(cfg: TaskChoice) -> list:
    """Held-out instances of the training templates (disjoint from every train instance)."""
    from tasksets.generator import generate

    if cfg.train_set not in CURRICULUM_SETS:
        return generate("eval_id", seed=cfg.task_seed)[: cfg.eval_id_episodes]
    pool = [
        t
        for t in generate("eval_id", count=400, seed=cfg.task_seed)
        if t.template in CURRICULUM_TEMPLATES
    ]
    return pool[: cfg.eval_id_episodes]


def eval_sets(cfg: TaskChoice) -> dict[str, list]:
    """{set name: its tasks} of the job's evaluations; a set asked for with 0 tasks
    (`--agentbench-eval-tasks 0`) is left out, as the gateway refuses an empty evaluation."""
    from tasksets import load_taskset

    agentbench = load_taskset("agentbench_os", "train")
    step = max(1, len(agentbench) // max(cfg.agentbench_eval_tasks, 1))
    sets = {
        "eval_id": _eval_id(cfg),
        "eval_ood": load_taskset("generated", "eval_ood", seed=cfg.task_seed)[
            : cfg.eval_ood_episodes
        ],
        "seeds": load_taskset("seeds"),
        "agentbench": agentbench[::step][: cfg.agentbench_eval_tasks],
    }
    return {name: tasks for name, tasks in sets.items() if tasks}


def content_key(task) -> str:
    """What makes two tasks the same instance whatever their ids: instruction, setup and checks."""
    from shellrl.contract import task_to_json

    body = task_to_json(task)
    return repr([body["instruction"], body["setup"], body["check"]])


HELD_OUT_SETS = ("eval_id", "eval_ood", "agentbench")
"""Eval sets no training task may share an instance with (by task id or content). `seeds` is not
one: the four seed tasks are trained on and evaluated as a check of fit, by design. Templates
of eval_ood may not enter training at all (eval_id's templates are the training templates)."""


def train_tasks(cfg: TaskChoice) -> list:
    """The training pool of the job, without any instance of a held-out eval set and without any
    eval_ood template (issue 33 item 2): `--train-set default` holds all 110 AgentBench tasks, of
    which `eval_sets` evaluates a sample, and a plug-in or task file may hold anything."""
    sets = eval_sets(cfg)
    held = [t for name in HELD_OUT_SETS for t in sets.get(name, [])]
    ids, contents = {t.task_id for t in held}, {content_key(t) for t in held}
    from tasksets.generator import templates_for

    ood_templates = {t.name for t in templates_for("eval_ood")}
    ood_templates |= {t.template for t in sets.get("eval_ood", []) if t.template}
    return [
        t
        for t in _train_pool(cfg)
        if t.task_id not in ids
        and t.template not in ood_templates
        and content_key(t) not in contents
    ]


def _train_pool(cfg: TaskChoice) -> list:
    from tasksets import load_taskset

    if cfg.train_set in CURRICULUM_SETS:
        generated = [
            t
            for t in load_taskset("generated", "train", seed=cfg.task_seed)
            if t.template in CURRICULUM_TEMPLATES
        ]
        contrast = (
            load_taskset("contrast", seed=cfg.task_seed) if cfg.train_set == "contrast" else []
        )
        return load_taskset("seeds") + generated + contrast
    return load_taskset(cfg.train_set, "train", seed=cfg.task_seed)
