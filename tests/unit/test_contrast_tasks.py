"""Contrast sets (tasksets/contrast.py, issue 33 item 2): the tasks of one file differ only in the
quantity asked, each label is that quantity of the file the setup writes (counted here from the
setup's text, as wc and grep -w do), every other quantity of the same file is a wrong answer to
the verifier's own check, and no quantity eval_ood asks (bytes, characters) is trained."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest

from services.verifier.answer_checks import answer_integer_equals
from shellrl.contract import task_to_json
from tasksets import load_taskset
from tasksets.contrast import CONTRAST_FILES, QUANTITIES, contrast_tasks
from tasksets.instances import HEREDOC_END


@pytest.fixture(scope="module")
def sets() -> dict[str, list]:
    by_set = defaultdict(list)
    for task in contrast_tasks():
        (key,) = [t.split(":", 1)[1] for t in task.tags if t.startswith("contrast_set:")]
        by_set[key].append(task)
    return dict(by_set)


def _file_text(setup: str) -> str:
    match = re.fullmatch(rf"cat > \S+ <<'{HEREDOC_END}'\n(.*){HEREDOC_END}", setup, re.S)
    assert match, setup
    return match.group(1)


def _expected(task) -> int:
    return task.checks[0].answer_integer_equals.expected


def test_every_file_is_asked_every_quantity_with_one_frame(sets):
    assert len(sets) == CONTRAST_FILES and len(load_taskset("contrast", "train")) == 48
    for tasks in sets.values():
        assert [t.template for t in tasks] == [f"contrast_{q.name}" for q in QUANTITIES]
        assert len({t.setup for t in tasks}) == 1 and len({t.task_id for t in tasks}) == 4
        # only the quantity's clause differs: same opening and same closing
        frames = {re.sub(r"How many .*\?", "How many _?", t.instruction) for t in tasks}
        assert len(frames) == 1, frames
        assert all(t.source == "shellrl:contrast" and t.reference_solution for t in tasks)
    assert not load_taskset("contrast", "eval_id") and not load_taskset("contrast", "eval_ood")


def test_each_label_is_the_quantity_of_the_file_the_setup_writes(sets):
    for tasks in sets.values():
        text = _file_text(tasks[0].setup)
        rows = text.splitlines()
        word = re.search(r"contain the word (\w+)\?", tasks[3].instruction).group(1)
        counted = {
            "lines": text.count("\n"),  # wc -l
            "words": len(text.split()),  # wc -w
            "distinct_words": len(set(text.split())),
            "lines_with_word": sum(bool(re.search(rf"\b{word}\b", r)) for r in rows),  # grep -cw
        }
        assert {t.template.removeprefix("contrast_"): _expected(t) for t in tasks} == counted


def test_the_check_accepts_the_asked_quantity_and_rejects_every_other_of_the_file(sets):
    for tasks in sets.values():
        values = [_expected(t) for t in tasks]
        assert len(set(values)) == len(values)  # the quantities differ pairwise
        for task in tasks:
            for value in values:
                passed, _ = answer_integer_equals(f"{value}\n", _expected(task))
                assert passed == (value == _expected(task)), (task.task_id, value)


def test_no_quantity_that_eval_ood_asks_is_trained():
    asked = " ".join(t.instruction.split("How many", 1)[1] for t in contrast_tasks())
    assert not re.search(r"byte|character|size|length", asked)


def test_contrast_sets_are_deterministic_by_seed():
    first = [task_to_json(t) for t in contrast_tasks(seed=0)]
    assert first == [task_to_json(t) for t in contrast_tasks(seed=0)]
    assert [t["task_id"] for t in first] != [t.task_id for t in contrast_tasks(seed=1)]
