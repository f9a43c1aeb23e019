"""Contrast sets of counting tasks (issue 33 item 2): one file, several tasks that differ only in
the quantity asked of it, so that answering with another quantity of the same file fails.

    contrast_tasks(seed=0, files=CONTRAST_FILES) -> list[Task]   (CONTRAST_FILES x 4 tasks)

Why: on every recorded run the trained policy lost a counting template by answering another
quantity of the same file, exactly (count_lines answered with the byte count, file_size_bytes
with the line count; BENCHMARKS.md, issue 33, `benchmarks/answer_quantities.py`): it stops
reading which quantity the instruction names. Here every file is asked for its lines, its words,
its distinct words and its lines containing one word, with one instruction frame; the four
numbers differ (an instance whose numbers coincide is redrawn), so one habitual `wc -l` earns 1
on one task of the set and 0 on the other three.

What is not asked, on purpose: bytes and characters. eval_ood's file_size_bytes asks the byte
size of the same kind of file (and longest_line a length in characters), so training either
would put an eval_ood question into training under another template name; whether reading the
quantity transfers to them is what eval_ood measures.

Tasks are deterministic by seed, split `train`, template `contrast_<quantity>`, task id
`contrast-<quantity>-<file fingerprint[:12]>`; the four tasks of one file share the fingerprint and
the tag `contrast_set:<fingerprint[:12]>`. Every expected answer is computed here in Python; the
reference solution is a shell command run only by validation. The verifier's own
answer_integer_equals grades them, so the reward is the real answer.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

from shellrl.contract import Task, task_from_json
from tasksets.instances import FILE_STEMS, WORDS, lines, write_file
from tasksets.templates.checks import answer_integer_equals

SOURCE = "shellrl:contrast"
CONTRAST_FILES = 12
"""Files (contrast sets) of `--train-set contrast`: 48 tasks beside the curriculum's 101."""
_MAX_TRIES_PER_FILE = 200


@dataclass(frozen=True)
class Quantity:
    """One quantity of a file of word rows. question: the end of "How many ...?" (`{word}` is the
    set's word). count: the value from the rows (each a list of words) and the word. reference:
    a shell command printing it (`{name}`, `{word}`). difficulty: the generator's label."""

    name: str
    question: str
    count: Callable[[list[list[str]], str], int]
    reference: str
    difficulty: str


QUANTITIES = (
    Quantity("lines", "lines does it contain", lambda rows, w: len(rows), "wc -l < {name}", "easy"),
    Quantity(
        "words",
        "words does it contain",
        lambda rows, w: sum(len(r) for r in rows),
        "wc -w < {name}",
        "easy",
    ),
    Quantity(
        "distinct_words",
        "distinct words does it contain",
        lambda rows, w: len({x for r in rows for x in r}),
        "tr ' ' '\\n' < {name} | sort -u | wc -l",
        "medium",
    ),
    Quantity(
        "lines_with_word",
        "of its lines contain the word {word}",
        lambda rows, w: sum(w in r for r in rows),
        "grep -cw {word} {name}",
        "medium",
    ),
)


@dataclass(frozen=True)
class ContrastFile:
    """One contrast set's file: its name, rows (words per line), the word of lines_with_word and
    every quantity's value ({Quantity.name: count}, pairwise different)."""

    name: str
    rows: tuple[tuple[str, ...], ...]
    word: str
    counts: dict[str, int]

    @property
    def text(self) -> str:
        return lines(" ".join(r) for r in self.rows)

    @property
    def setup(self) -> str:
        return write_file(self.name, self.text)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.setup.encode()).hexdigest()


def draw_file(rng: random.Random) -> ContrastFile:
    """A file of 4-14 rows of 1-5 words from 3-8 distinct words (so words repeat), a word found on
    some rows but not all, and the four counts, redrawn until they differ pairwise. Raises
    ValueError if no such file comes in _MAX_TRIES_PER_FILE draws (never seen)."""
    for _ in range(_MAX_TRIES_PER_FILE):
        pool = rng.sample(WORDS, rng.randint(3, 8))
        rows = [rng.choices(pool, k=rng.randint(1, 5)) for _ in range(rng.randint(4, 14))]
        word = rng.choice(pool)
        counts = {q.name: q.count(rows, word) for q in QUANTITIES}
        if 0 < counts["lines_with_word"] < len(rows) and len(set(counts.values())) == len(counts):
            name = f"{rng.choice(FILE_STEMS)}.txt"
            return ContrastFile(name, tuple(tuple(r) for r in rows), word, counts)
    raise ValueError(f"no file with {len(QUANTITIES)} different counts in {_MAX_TRIES_PER_FILE}")


def instruction(file: ContrastFile, quantity: Quantity) -> str:
    """The one frame of every task of a set; only the quantity's clause differs."""
    return (
        f"The file {file.name} holds lines of words separated by single spaces. How many "
        f"{quantity.question.format(word=file.word)}? Answer with just the number."
    )


def to_task(file: ContrastFile, quantity: Quantity) -> Task:
    """The task asking `quantity` of `file` (validated)."""
    key = file.fingerprint[:12]
    return task_from_json(
        {
            "task_id": f"contrast-{quantity.name}-{key}",
            "instruction": instruction(file, quantity),
            "setup": file.setup,
            "check": [answer_integer_equals(file.counts[quantity.name])],
            "split": "train",
            "tags": [
                "contrast",
                f"template:contrast_{quantity.name}",
                f"difficulty:{quantity.difficulty}",
                "answer",
                f"contrast_set:{key}",
            ],
            "source": SOURCE,
            "reference_solution": quantity.reference.format(name=file.name, word=file.word),
            "template": f"contrast_{quantity.name}",
        }
    )


def contrast_files(seed: int = 0, files: int = CONTRAST_FILES) -> list[ContrastFile]:
    """`files` distinct files (by setup), deterministic by `seed`."""
    out: dict[str, ContrastFile] = {}
    for i in range(files * _MAX_TRIES_PER_FILE):
        if len(out) == files:
            break
        file = draw_file(random.Random(f"shellrl-contrast:{seed}:{i}"))
        out.setdefault(file.fingerprint, file)
    return list(out.values())


def contrast_tasks(seed: int = 0, files: int = CONTRAST_FILES) -> list[Task]:
    """Every quantity of each of `files` files: `files * len(QUANTITIES)` tasks, a set's tasks
    adjacent (the job's pool is shuffled per epoch anyway)."""
    return [to_task(f, q) for f in contrast_files(seed, files) for q in QUANTITIES]
