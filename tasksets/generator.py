"""Programmatic shell tasks from templates, in three splits.

  train     instances of the training templates (templates.py)
  eval_id   held-out instances of the same templates: no instance is also in train
  eval_ood  instances of templates never trained on (templates_ood.py)

Deterministic: the same (split, count, seed) gives the same tasks on every machine (each
instance has its own `random.Random` seeded with a string, which Python hashes with SHA-512,
independent of PYTHONHASHSEED). Instances are distinct by content (instruction, setup, checks);
templates are used round-robin so every template is represented.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterator

from shellrl.contract import Task, task_from_json
from tasksets import templates as _train_templates  # noqa: F401  (registers the templates)
from tasksets import templates_ood as _ood_templates  # noqa: F401
from tasksets.instances import TEMPLATES, Instance, Template

SOURCE = "shellrl:generator"
SPLITS = ("train", "eval_id", "eval_ood")
DEFAULT_COUNTS = {"train": 320, "eval_id": 96, "eval_ood": 96}
DEFAULT_SEED = 0
_MAX_TRIES_PER_TASK = 50


def templates_for(split: str) -> list[Template]:
    """Templates of a split, in registry order. Raises ValueError for an unknown split."""
    if split not in SPLITS:
        raise ValueError(f"unknown generated split {split!r}; one of {SPLITS}")
    ood = split == "eval_ood"
    return [t for t in TEMPLATES.values() if t.ood == ood]


def fingerprint(instance: Instance) -> str:
    """sha256 of what makes an instance distinct (instruction, setup, checks, env)."""
    body = json.dumps(
        [instance.instruction, instance.setup, instance.checks, instance.env], sort_keys=True
    )
    return hashlib.sha256(body.encode()).hexdigest()


def _stream(split_seed: str, tmpl: Template) -> Iterator[Instance]:
    for i in range(10**9):
        yield tmpl.build(random.Random(f"{split_seed}:{tmpl.name}:{i}"))


HELDOUT_BUCKETS = 8
"""An instance of a training template is held out (eval_id) iff its fingerprint falls in bucket 0
of 8, so train and eval_id are disjoint for any counts and seeds of the same generator."""


def in_heldout(fp: str) -> bool:
    return int(fp[:8], 16) % HELDOUT_BUCKETS == 0


def _instances(split: str, count: int, seed: int) -> list[tuple[Template, Instance, str]]:
    """`count` distinct instances of the split's templates, round-robin."""
    tmpls = templates_for(split)
    streams = {
        t.name: _stream(f"shellrl-gen:{seed}:{'ood' if split == 'eval_ood' else 'id'}", t)
        for t in tmpls
    }
    accept = {
        "train": lambda fp: not in_heldout(fp),
        "eval_id": in_heldout,
        "eval_ood": lambda fp: True,
    }[split]
    tries = _MAX_TRIES_PER_TASK * (HELDOUT_BUCKETS if split == "eval_id" else 1)
    seen: set[str] = set()
    out: list[tuple[Template, Instance, str]] = []
    exhausted: set[str] = set()
    while len(out) < count:
        if len(exhausted) == len(tmpls):
            raise ValueError(
                f"split {split}: only {len(out)} distinct instances exist, {count} asked"
            )
        for tmpl in tmpls:
            if len(out) >= count or tmpl.name in exhausted:
                continue
            for _ in range(tries):
                inst = next(streams[tmpl.name])
                fp = fingerprint(inst)
                if fp not in seen and accept(fp):
                    seen.add(fp)
                    out.append((tmpl, inst, fp))
                    break
            else:
                exhausted.add(tmpl.name)
    return out


def to_task(tmpl: Template, inst: Instance, fp: str, split: str) -> Task:
    """A generated instance as a validated `Task` (task_id `gen-<template>-<fingerprint[:12]>`)."""
    return task_from_json(
        {
            "task_id": f"gen-{tmpl.name}-{fp[:12]}",
            "instruction": inst.instruction,
            "setup": inst.setup,
            "env": inst.env,
            "check": inst.checks,
            "split": split,
            "tags": [
                "generated",
                f"template:{tmpl.name}",
                f"difficulty:{tmpl.difficulty}",
                tmpl.kind,
            ],
            "source": SOURCE,
            "reference_solution": inst.reference_solution,
            "template": tmpl.name,
        }
    )


def generate_with_wrong_answers(
    split: str, count: int | None = None, seed: int = DEFAULT_SEED
) -> list[tuple[Task, str]]:
    """(task, a plausible wrong answer) pairs; see `generate`."""
    if split not in SPLITS:
        raise ValueError(f"unknown generated split {split!r}; one of {SPLITS}")
    count = DEFAULT_COUNTS[split] if count is None else count
    return [
        (to_task(t, i, fp, split), i.wrong_answer) for t, i, fp in _instances(split, count, seed)
    ]


def generate(split: str, count: int | None = None, seed: int = DEFAULT_SEED) -> list[Task]:
    """`count` (default DEFAULT_COUNTS[split]) distinct tasks of `split`, deterministic by `seed`.

    train and eval_id come from the same templates and never share an instance; eval_ood comes
    from templates that neither uses. Raises ValueError for an unknown split or when the
    templates cannot yield `count` distinct instances.
    """
    return [task for task, _ in generate_with_wrong_answers(split, count, seed)]
