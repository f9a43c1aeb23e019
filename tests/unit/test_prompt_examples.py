"""The agent prompt's worked examples show the protocol, never a task (issue 33).

Until issue 33 the three examples of `services/rollout/prompt.py` FEW_SHOT were instances of
grep_count, line_n and eval_ood's file_size_bytes, each with its template's own command
(`wc -c < data.bin` for "What is the size of the file data.bin in bytes?"). The base policy's only
eval_ood successes were copies of that example (docs/runs/issue33-2026-12-06-cpu/old-prompt-s0/
eval_ood_transcripts.txt), lost at step 5 of training in each of three seeds, in 5, 10 and 5 with
the broad pool (docs/runs/gpu-2026-12-06-h100-protocol/compare-{during,broad5}/compare.md). So
eval_ood measured in-context copying, not transfer. This test compares every example with every
task the job can train or evaluate on: all generated templates (train, eval_id, eval_ood; task
seeds 0 and 1), the contrast sets, the seed tasks and all 110 AgentBench tasks. An example leaks a
task when its question shares most content words with the task's instruction (names and numbers
masked), or half its content-word pairs, or when its command's stages (program and flags, without
arguments or option values) run in that order within the task's reference command. It guards
against copies, not against every paraphrase: a reviewer still reads a new example.
"""

from __future__ import annotations

import re
import shlex

import pytest

from services.rollout.prompt import FEW_SHOT
from tasksets import load_taskset

# the examples before issue 33 and the template each copied (the checker's right value)
EXAMPLES_BEFORE_ISSUE_33 = (
    (
        "How many lines of the file app.log contain the word ERROR?",
        "<bash>grep -c ERROR app.log</bash>",
        "grep_count",
    ),
    (
        "What is the size of the file data.bin in bytes?",
        "<bash>wc -c < data.bin</bash>",
        "file_size_bytes",
    ),
    ("Print the second line of the file names.txt.", "<bash>sed -n 2p names.txt</bash>", "line_n"),
)
# near-copies the checker must also catch: by command alone (another spelling of a reference
# command, or one stage of a reference pipeline) or by question alone
NEAR_COPIES = (
    ("Show the final line of notes.log.", "<bash>tail -1 notes.log</bash>", "last_line"),
    ("How large is report.txt?", "<bash>wc --bytes < report.txt</bash>", "file_size_bytes"),
    ("Count them.", "<bash>zcat log.txt.gz | wc -l</bash>", "gzip_line_count"),
    ("Count them.", "<bash>sort -u</bash>", "unique_ips"),
    (
        "What is the size of the file notes.txt in bytes? Answer with just the number.",
        "<bash>true</bash>",
        "file_size_bytes",
    ),
)
# content-word overlap (Jaccard; stop words, names and numbers left out, `_overlap`) of an example
# question and a task's instruction from which the example counts as that task's question: the
# old grep_count and file_size_bytes examples have 1.0 with their templates, the old line_n one
# 0.33 (its command gives it away). AgentBench's instructions are long (19-92 words), so a short
# question is also compared by the share of its content-word pairs found in one instruction
QUESTION_OVERLAP = 0.5
CONTENT_PAIRS = 0.5
# what the new examples reach at most with any task (asserted below: the nearest, 0.17, is 'files'
# beside count_files' 'files' and 'shell' beside shell_arithmetic's 'shell'; no content-word pair
# in common with any task)
NEW_EXAMPLES_OVERLAP = 0.2
_STOP = set(
    "a an the of in on at to is are be this that which what how many much does do with and or "
    "its it for from as by your you just answer number file zzfile zznum".split()
)
# long options and digit flags spelled as the short flag they mean, per program
_LONG = {
    "wc": {"--bytes": "-c", "--lines": "-l", "--words": "-w", "--chars": "-m"},
    "head": {"--lines": "-n", "--bytes": "-c"},
    "tail": {"--lines": "-n", "--bytes": "-c"},
    "grep": {"--count": "-c", "--line-number": "-n", "--ignore-case": "-i"},
    "sort": {"--unique": "-u", "--numeric-sort": "-n", "--reverse": "-r"},
}
_OPERATORS = {"|", "||", "&&", ";", "&", "(", ")"}
_REDIRECTS = {"<", ">", ">>", "<<", "<<<", ">&", "<&", "&>", "2>"}


def _words(text: str) -> list[str]:
    text = re.sub(r"Answer with[^.?]*[.?]", " ", text)  # the generator's answer-format sentence
    text = re.sub(r"\b[\w-]+\.[A-Za-z]\w*\b", " zzfile ", text)  # file names
    text = re.sub(r"\d+", " zznum ", text)
    return re.findall(r"[a-z]+", text.lower())


def _overlap(a: list[str], b: list[str]) -> float:
    """Jaccard of the content words (stop words, masked names and numbers left out)."""
    sa, sb = set(a) - _STOP, set(b) - _STOP
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0


def _content_pairs(words: list[str]) -> set[tuple[str, str]]:
    content = [w for w in words if w not in _STOP]
    return set(zip(content, content[1:]))


def _pair_share(example: list[str], task: list[str]) -> float:
    pairs = _content_pairs(example)
    return len(pairs & _content_pairs(task)) / len(pairs) if pairs else 0.0


def _flags(program: str, word: str) -> list[str]:
    if word.startswith("--"):
        name = word.split("=")[0]
        return [_LONG.get(program, {}).get(name, name)]
    letters = word[1:]
    if letters.isdigit():  # head -5, tail -1
        return ["-n"]
    if letters.isalpha():  # -rn = -r -n
        return [f"-{c}" for c in letters]
    return [word[:2]]  # -n1, -d, -f2-: the flag without its value


def _stages(command: str) -> list[tuple[str, ...]]:
    """The command's stages in order (pipelines, lists, lines): each its program and sorted
    flags; arguments, option values, redirections with their targets, comments and `cd` left out."""
    command = re.sub(r"</?bash>", "", command)
    stages: list[tuple[str, ...]] = []
    for line in command.splitlines():
        try:
            tokens = list(shlex.shlex(line, posix=True, punctuation_chars=True))
        except ValueError:  # an unclosed quote
            tokens = line.split()
        words: list[str] = []
        skip = False
        for token in [*tokens, ";"]:
            if skip:
                skip = False
            elif token in _REDIRECTS:
                skip = True  # and its target
            elif token not in _OPERATORS:
                words.append(token)
            elif words:
                program, args = words[0], words[1:]
                if program not in ("cd", "then", "do", "done", "fi", "else"):
                    flags = {f for w in args if w.startswith("-") for f in _flags(program, w)}
                    stages.append((program, *sorted(flags)))
                words = []
    return stages


def _is_part(part: list, whole: list) -> bool:
    n = len(part)
    return n > 0 and any(whole[i : i + n] == part for i in range(len(whole) - n + 1))


def _all_tasks() -> list:
    tasks = load_taskset("seeds") + load_taskset("agentbench_os") + load_taskset("contrast")
    for seed in (0, 1):
        tasks += load_taskset("generated", seed=seed)
    return tasks


@pytest.fixture(scope="module")
def tasks():
    from tasksets.generator import templates_for

    tasks = _all_tasks()
    every = {t.name for split in ("train", "eval_ood") for t in templates_for(split)}
    assert every | {"contrast_lines", "contrast_words"} <= {t.template for t in tasks}
    assert sum(t.source.startswith("THUDM/AgentBench") for t in tasks) == 110
    return tasks


def _leaks(question: str, command: str, tasks) -> dict[str, str]:
    """{template or task id: why} of every task the example resembles."""
    words, stages = _words(question), _stages(command)
    found = {}
    for t in tasks:
        task_words = _words(t.instruction)
        overlap, pairs = _overlap(words, task_words), _pair_share(words, task_words)
        same_command = bool(t.reference_solution) and _is_part(
            stages, _stages(t.reference_solution)
        )
        if overlap >= QUESTION_OVERLAP or pairs >= CONTENT_PAIRS or same_command:
            found[t.template or t.task_id] = (
                f"{t.task_id}: overlap {overlap:.2f}, content pairs {pairs:.2f}, "
                f"command {same_command}"
            )
    return found


@pytest.mark.parametrize("question,command,template", EXAMPLES_BEFORE_ISSUE_33 + NEAR_COPIES)
def test_copies_and_near_copies_of_tasks_are_caught(tasks, question, command, template):
    assert template in _leaks(question, command, tasks)


def test_commands_are_compared_stage_by_stage_without_arguments():
    assert _stages("<bash>zcat a.gz | wc -l</bash>") == [("zcat",), ("wc", "-l")]
    assert _stages("# count\ncd /tmp && grep -rn 'x|y' . > out.txt") == [("grep", "-n", "-r")]
    assert _stages("tail -1 f") == _stages("tail -n 1 f") == _stages("tail --lines=1 f")
    assert (
        _stages("cut -d, -f2- f.csv") == _stages("cut -d ' ' -f 2 f.csv") == [("cut", "-d", "-f")]
    )
    assert _stages("echo 'unclosed") == [("echo",)]


@pytest.mark.parametrize("example", FEW_SHOT, ids=[e[1] for e in FEW_SHOT])
def test_no_worked_example_is_a_task_of_any_task_set(tasks, example):
    question, command, _output, _answer = example
    assert _leaks(question, command, tasks) == {}
    nearest = max(tasks, key=lambda t: _overlap(_words(question), _words(t.instruction)))
    overlap = _overlap(_words(question), _words(nearest.instruction))
    assert overlap <= NEW_EXAMPLES_OVERLAP, (nearest.task_id, overlap)


def test_no_worked_example_runs_a_program_any_reference_command_runs(tasks):
    """The second example's `grep -n milk todo.txt` (d378a55) was copied by a trained policy into
    `cat NAME | grep -n1 -n1 ...` on count_lines and cat_file, to the token limit
    (docs/runs/issue33-2026-12-06-cpu/new-s2): an example program that a task's reference
    command also runs is a shortcut the policy takes instead of the task's own command."""
    programs = {stage[0] for t in tasks for stage in _stages(t.reference_solution or "")}
    assert "grep" in programs  # the checker's right value for the example it replaces
    assert {_stages(command)[0][0] for _q, command, _o, _a in FEW_SHOT} & programs == set()
