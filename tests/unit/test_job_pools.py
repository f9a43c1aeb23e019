"""The main job's training pool never holds what it is evaluated on (issue 33 item 2): no instance
of eval_id, eval_ood or the AgentBench eval sample, and no eval_ood template, by task id, by
template and by content, for the pools `shellrl run` builds (cli/job_tasks.py)."""

from __future__ import annotations

import pytest

from cli.job_config import JobConfig
from cli.job_tasks import HELD_OUT_SETS, content_key, eval_sets, train_tasks
from tasksets.generator import generate, templates_for


@pytest.mark.parametrize(
    "cfg",
    [
        JobConfig(),
        JobConfig(train_set="default"),
        JobConfig(train_set="contrast"),
        JobConfig(task_seed=3),
        JobConfig(train_set="contrast", task_seed=3, eval_ood_episodes=96),
        JobConfig(eval_ood_episodes=96, agentbench_eval_tasks=110),
    ],
    ids=[
        "curriculum",
        "default-set",
        "contrast",
        "task-seed-3",
        "contrast-task-seed-3-all-ood",
        "largest-eval-sets",
    ],
)
def test_no_eval_instance_or_eval_ood_template_enters_training(cfg):
    sets, train = eval_sets(cfg), train_tasks(cfg)
    assert train and all(sets[name] for name in HELD_OUT_SETS)
    train_ids, train_contents = {t.task_id for t in train}, {content_key(t) for t in train}
    train_templates = {t.template for t in train}
    for name in HELD_OUT_SETS:
        assert not train_ids & {t.task_id for t in sets[name]}, name
        assert not train_contents & {content_key(t) for t in sets[name]}, name
    ood_templates = {t.name for t in templates_for("eval_ood")}
    assert {t.template for t in sets["eval_ood"]} <= ood_templates
    assert not train_templates & ood_templates
    # eval_id tests the training templates on held-out instances, so it shares templates only
    assert {t.template for t in sets["eval_id"]} <= train_templates


def test_the_default_set_trains_on_agentbench_except_the_evaluated_sample():
    cfg = JobConfig(train_set="default")
    train_ids = {t.task_id for t in train_tasks(cfg)}
    agentbench = [t for t in train_tasks(cfg) if t.source.startswith("THUDM/AgentBench")]
    assert len(agentbench) == 110 - cfg.agentbench_eval_tasks
    assert not train_ids & {t.task_id for t in eval_sets(cfg)["agentbench"]}


def test_a_set_asked_for_with_no_tasks_is_left_out_of_the_evaluations():
    # `shellrl run --agentbench-eval-tasks 0` died with a traceback after the stack started: the
    # gateway answers 422 to an evaluation of no tasks (task_ids: min_length 1)
    cfg = JobConfig(agentbench_eval_tasks=0, eval_ood_episodes=0, eval_id_episodes=2)
    sets = eval_sets(cfg)
    assert set(sets) == {"eval_id", "seeds"} and len(sets["eval_id"]) == 2
    assert all(sets.values())
    assert train_tasks(cfg)


def test_the_contrast_pool_is_the_curriculum_plus_contrast_sets_on_the_same_eval_sets():
    # `--train-set contrast` is compared with the default run for run (issue 33 item 2): same
    # eval sets, same curriculum tasks, plus the 48 contrast tasks, none sharing a file with an
    # eval task (the same file asked another way would be an eval instance reworded)
    curriculum, contrast = JobConfig(), JobConfig(train_set="contrast")
    assert {name: [t.task_id for t in tasks] for name, tasks in eval_sets(contrast).items()} == {
        name: [t.task_id for t in tasks] for name, tasks in eval_sets(curriculum).items()
    }
    base = [t.task_id for t in train_tasks(curriculum)]
    added = [t for t in train_tasks(contrast) if t.task_id not in set(base)]
    assert [t.task_id for t in train_tasks(contrast)][: len(base)] == base
    assert len(added) == 48 and {t.source for t in added} == {"shellrl:contrast"}
    held = {t.setup for name in HELD_OUT_SETS for t in eval_sets(contrast)[name]}
    held |= {t.setup for split in ("eval_id", "eval_ood") for t in generate(split, count=400)}
    assert not {t.setup for t in added} & held
