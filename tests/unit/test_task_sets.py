"""Task sets: the generator's splits, determinism and difficulty; the seed tasks; the public loader."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from shellrl.contract import split_name, task_to_json
from tasksets import load_taskset
from tasksets.generator import TEMPLATES, generate, generate_with_wrong_answers, templates_for
from tasksets.instances import write_file
from tasksets.seeds import SHA256_EXPECTED, SHA256_WITH_NEWLINE, WRONG_ANSWERS, seed_tasks

# printf '%s' nano_miles_rl | sha256sum   and   echo nano_miles_rl | sha256sum   (coreutils, by hand)
NO_NEWLINE = "040ef1c12b686434e246bd59f9a35e72916243c6e72c8294a0089fea08bf7e2b"
WITH_NEWLINE = "abecbdfca4de3e90c24e4528184a70888e452444aa5d2ecce63b645b74795704"


@pytest.fixture(scope="module")
def splits():
    return {s: generate(s) for s in ("train", "eval_id", "eval_ood")}


def _content(task) -> str:
    body = task_to_json(task)
    return repr([body["instruction"], body["setup"], body["check"]])


def test_generator_has_at_least_15_templates_with_ood_ones_apart():
    train, ood = templates_for("train"), templates_for("eval_ood")
    assert len(TEMPLATES) >= 15 and len(train) >= 15 and len(ood) >= 5
    assert templates_for("eval_id") == train
    assert not {t.name for t in train} & {t.name for t in ood}


def test_splits_are_large_enough_distinct_and_disjoint(splits):
    train, eval_id, eval_ood = splits["train"], splits["eval_id"], splits["eval_ood"]
    assert len({_content(t) for t in train}) == len(train) >= 200
    assert len({_content(t) for t in eval_id}) == len(eval_id) >= 64
    assert len({_content(t) for t in eval_ood}) == len(eval_ood) >= 64
    assert not {_content(t) for t in train} & {_content(t) for t in eval_id}
    assert {t.template for t in eval_id} <= {t.template for t in train}
    assert not {t.template for t in eval_ood} & {t.template for t in train}
    assert all(split_name(t.split) == s for s, ts in splits.items() for t in ts)


def test_train_and_eval_id_stay_disjoint_for_larger_counts():
    train = {_content(t) for t in generate("train", 1000)}
    assert not train & {_content(t) for t in generate("eval_id", 200)}


def test_generation_is_deterministic_by_seed(splits):
    assert [task_to_json(t) for t in generate("train")] == [
        task_to_json(t) for t in splits["train"]
    ]
    assert [t.task_id for t in generate("train", seed=1)] != [t.task_id for t in splits["train"]]


def test_every_template_is_used_and_tagged_with_difficulty(splits):
    used = Counter(t.template for ts in splits.values() for t in ts)
    assert set(used) == set(TEMPLATES)
    for task in splits["train"]:
        assert task.reference_solution and task.source == "shellrl:generator"
        assert f"template:{task.template}" in task.tags
        assert any(re.fullmatch(r"difficulty:(easy|medium|hard)", tag) for tag in task.tags)
    easy = sum("difficulty:easy" in t.tags for t in splits["train"])
    assert easy >= len(splits["train"]) // 3  # a 135M model must solve some train tasks


def test_wrong_answers_differ_from_the_expected_answer():
    for task, wrong in generate_with_wrong_answers("train", 100):
        for check in task.checks:
            kind = check.WhichOneof("kind")
            if kind == "answer_integer_equals":
                assert wrong.strip() != str(check.answer_integer_equals.expected)
            elif kind == "answer_equals":
                assert wrong.strip().lower() != check.answer_equals.expected.strip().lower()


def test_count_lines_label_equals_the_lines_written_by_setup(splits):
    for task in (t for t in splits["train"] if t.template == "count_lines"):
        body = task.setup.split("\n", 1)[1].rsplit("SHELLRL_EOF", 1)[0]
        assert body.count("\n") == task.checks[0].answer_integer_equals.expected


def test_write_file_refuses_content_that_would_end_the_heredoc():
    with pytest.raises(ValueError):
        write_file("a.txt", "x\nSHELLRL_EOF\n")


def test_seed_tasks_state_the_no_newline_decision_and_wrong_answers():
    tasks = {t.task_id: t for t in seed_tasks()}
    assert set(tasks) == {"seed-sha256", "seed-numbers", "seed-uname", "seed-product"}
    assert SHA256_EXPECTED == NO_NEWLINE and SHA256_WITH_NEWLINE == WITH_NEWLINE
    assert tasks["seed-sha256"].checks[0].answer_equals.expected == NO_NEWLINE
    assert "without a trailing newline" in tasks["seed-sha256"].instruction
    assert WRONG_ANSWERS["seed-sha256"] == WITH_NEWLINE and WRONG_ANSWERS["seed-uname"] == "Linux"
    assert tasks["seed-product"].checks[0].answer_integer_equals.expected == 1234 * 5678


def test_public_set_loads_110_agentbench_tasks_with_their_env():
    tasks = load_taskset("agentbench_os")
    assert len(tasks) == 110 and all(split_name(t.split) == "train" for t in tasks)
    assert sum(t.env.get("HOME") == "<workspace>" for t in tasks) == 97
    assert all(t.reference_solution for t in tasks)


def test_default_set_combines_seeds_generated_and_public():
    assert len(load_taskset("default", "train")) == 4 + 320 + 110
    assert len(load_taskset("default", "eval_ood")) == 96
    with pytest.raises(ValueError):
        load_taskset("nope")


def test_difficulty_of_reads_the_tag():
    from tasksets import difficulty_of

    assert (
        difficulty_of(next(t for t in generate("train", 40) if t.template == "cat_file")) == "easy"
    )
    assert difficulty_of(load_taskset("agentbench_os")[0]) == ""
