"""The agent prompt's worked examples show the protocol, never a task (issue 33).

Until issue 33 the three examples of `services/rollout/prompt.py` FEW_SHOT were instances of
grep_count, line_n and eval_ood's file_size_bytes, each with its template's own command
(`wc -c < data.bin` for "What is the size of the file data.bin in bytes?"). The base policy's only
eval_ood successes were copies of that example, and training on the counting templates unlearned
the copy within 5-10 steps in every seed (BENCHMARKS.md, "Learning that transfers"). So eval_ood
measured in-context copying, not transfer. This test compares every example with every task the
job can train or evaluate on: all generated templates (train, eval_id, eval_ood), the contrast
sets, the seed tasks and all AgentBench tasks. An example leaks a task when its question's words
are mostly the task's (names and numbers masked) or its command is the task's reference command
with other file names and numbers (the same programs with the same flags).
"""

from __future__ import annotations

import re
import shlex

import pytest

from services.rollout.prompt import FEW_SHOT
from tasksets import load_taskset

# the examples before issue 33: each must be caught (the checker's right value)
EXAMPLES_BEFORE_ISSUE_33 = (
    (
        "How many lines of the file app.log contain the word ERROR?",
        "<bash>grep -c ERROR app.log</bash>",
    ),
    ("What is the size of the file data.bin in bytes?", "<bash>wc -c < data.bin</bash>"),
    ("Print the second line of the file names.txt.", "<bash>sed -n 2p names.txt</bash>"),
)
# word overlap (Jaccard, names and numbers masked) of an example question and a task's
# instruction from which the example counts as that task's question: the old grep_count and
# file_size_bytes examples have 0.6-0.69 with their templates (line_n's only 0.31: its command
# gives it away); the examples now stay at or below 0.35 with every task (asserted below: the
# nearest, 0.31, is the grep -n question's 'line of the file NAME' beside eval_ood's last_line)
QUESTION_OVERLAP = 0.5


def _words(text: str) -> set[str]:
    text = re.sub(r"\b[\w-]+\.[A-Za-z]\w*\b", " FILE ", text)  # file names
    text = re.sub(r"\d+", " NUM ", text)
    return set(re.findall(r"[A-Za-z]+", text.lower()))


def _signature(command: str) -> tuple[tuple[str, ...], ...]:
    """Per pipeline stage: the program and its flags (arguments and redirections dropped)."""
    command = re.sub(r"</?bash>", "", command)
    stages = []
    for stage in re.split(r"\|\||&&|[|;\n]", command):
        try:
            words = shlex.split(stage)
        except ValueError:
            words = stage.split()
        if words:
            stages.append((words[0], *sorted(w for w in words[1:] if w.startswith("-"))))
    return tuple(stages)


def _all_tasks() -> list:
    tasks = load_taskset("seeds") + load_taskset("agentbench_os") + load_taskset("contrast")
    for seed in (0, 1):
        tasks += load_taskset("generated", seed=seed)
    return tasks


@pytest.fixture(scope="module")
def tasks():
    tasks = _all_tasks()
    assert {"file_size_bytes", "grep_count", "line_n", "count_lines"} <= {t.template for t in tasks}
    return tasks


def _overlap(a: set[str], b: set[str]) -> float:
    return len(a & b) / len(a | b)


def _leaks(question: str, command: str, tasks) -> list[str]:
    words, signature = _words(question), _signature(command)
    found = []
    for t in tasks:
        overlap = _overlap(words, _words(t.instruction))
        same_command = t.reference_solution and _signature(t.reference_solution) == signature
        if overlap >= QUESTION_OVERLAP or same_command:
            found.append(
                f"{t.task_id} (question overlap {overlap:.2f}, same command {bool(same_command)})"
            )
    return found


@pytest.mark.parametrize("question,command", EXAMPLES_BEFORE_ISSUE_33)
def test_the_examples_before_issue_33_are_caught_as_tasks(tasks, question, command):
    assert _leaks(question, command, tasks)


@pytest.mark.parametrize("example", FEW_SHOT, ids=[e[1] for e in FEW_SHOT])
def test_no_worked_example_is_a_task_of_any_task_set(tasks, example):
    question, command, _output, _answer = example
    assert _leaks(question, command, tasks) == []
    worst = max(_overlap(_words(question), _words(t.instruction)) for t in tasks)
    assert worst <= 0.35, worst
