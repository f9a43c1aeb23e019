"""Task sets of shellrl: built-in seed tasks, generated tasks in three splits, public task files.

    load_taskset(name, split=None) -> list[Task]

  name            splits                          what
  seeds           train                           the four tasks of the seed write-up (seeds.py)
  generated       train, eval_id, eval_ood        template tasks (generator.py; 320/96/96 by default)
  agentbench_os   train                           110 AgentBench OS tasks (public.py, Apache-2.0)
  contrast        train                           counting tasks in contrast sets: one file asked
                                                  for different quantities (contrast.py; 48)
  default         train, eval_id, eval_ood        train = seeds + generated train + agentbench_os;
                                                  eval_id / eval_ood = the generated ones
  <path>.jsonl    whatever the file holds         a task file in the JSON form
  <plug-in name>  what the plug-in gives          a task source installed by a package
                                                  (entry point group shellrl.tasksets)

Every task comes back validated by `shellrl.contract.task_from_json`. Whether its reference
solution really passes (and a wrong answer fails) is checked against a real sandbox by
`python -m tasksets validate` (validate.py), with results cached per task content.
"""

from __future__ import annotations

from pathlib import Path

from shellrl.contract import Task, iter_tasks_jsonl, split_name

TASKSETS = ("seeds", "generated", "agentbench_os", "contrast", "default")
SPLITS = ("train", "eval_id", "eval_ood", "eval")


def load_taskset(name: str, split: str | None = None, *, seed: int = 0) -> list[Task]:
    """Tasks of set `name` (see the module docstring), only those of `split` when given.

    seed: generator seed of the `generated` part. Raises ValueError for an unknown set or split,
    TaskValidationError for a bad task file.
    """
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; one of {SPLITS}")
    if name.endswith(".jsonl"):
        with open(Path(name), encoding="utf-8") as f:
            tasks = list(iter_tasks_jsonl(f))
    elif name == "seeds":
        from tasksets.seeds import seed_tasks

        tasks = seed_tasks()
    elif name == "generated":
        from tasksets.generator import SPLITS as GENERATED
        from tasksets.generator import generate

        splits = [split] if split in GENERATED else ([] if split else list(GENERATED))
        tasks = [t for s in splits for t in generate(s, seed=seed)]
    elif name == "agentbench_os":
        from tasksets.public import load_public

        tasks = load_public("agentbench_os")
    elif name == "contrast":
        from tasksets.contrast import contrast_tasks

        tasks = contrast_tasks(seed=seed)
    elif name == "default":
        tasks = (
            load_taskset("seeds", split)
            + load_taskset("generated", split, seed=seed)
            + load_taskset("agentbench_os", split)
        )
    else:  # a plug-in's task set (entry point group shellrl.tasksets; plugin_sources.py)
        from tasksets.plugin_sources import plugin_taskset

        tasks = plugin_taskset(name, split, seed, TASKSETS)
        if tasks is None:
            raise ValueError(
                f"unknown task set {name!r}; one of {TASKSETS}, a plug-in's or a .jsonl path"
            )
    return [t for t in tasks if split is None or split_name(t.split) == split]


def difficulty_of(task: Task) -> str:
    """The `difficulty:<easy|medium|hard>` tag of a generated or seed task; "" when it has none."""
    return next((t.split(":", 1)[1] for t in task.tags if t.startswith("difficulty:")), "")


__all__ = ["SPLITS", "TASKSETS", "difficulty_of", "load_taskset"]
