"""Building blocks of generated tasks: the `Instance` a template returns, the template registry,
and helpers that write deterministic setup scripts.

A template is a function `(rng: random.Random) -> Instance`. It computes the expected answer (or
the expected end state) itself, in Python, from the values it chose; the reference solution is
a separate shell script that is only run by validation, never used to compute a label.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

DIFFICULTIES = ("easy", "medium", "hard")


@dataclass(frozen=True)
class Instance:
    """One generated task before it becomes a `Task`.

    checks: check objects in JSON form (`{"type": ..., ...}`, see shellrl.contract.check_from_json).
    wrong_answer: a plausible but wrong final answer, for validation (must fail when submitted
    without running the reference solution).
    """

    instruction: str
    setup: str
    checks: list[dict]
    reference_solution: str
    wrong_answer: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Template:
    """name: registry key and Task.template. difficulty: easy | medium | hard (a label for
    curricula and reports). ood: reserved for eval_ood, never used for train or eval_id.
    kind: "answer" (graded on the final answer) or "file_state" (graded on the workspace)."""

    name: str
    build: Callable[[random.Random], Instance]
    difficulty: str
    ood: bool
    kind: str


TEMPLATES: dict[str, Template] = {}


def template(name: str, difficulty: str, *, ood: bool = False, kind: str = "answer"):
    """Register a template function under `name`."""
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"template {name}: difficulty must be one of {DIFFICULTIES}")

    def register(fn: Callable[[random.Random], Instance]) -> Callable[[random.Random], Instance]:
        if name in TEMPLATES:
            raise ValueError(f"template {name!r} registered twice")
        TEMPLATES[name] = Template(name, fn, difficulty, ood, kind)
        return fn

    return register


HEREDOC_END = "SHELLRL_EOF"


def write_file(path: str, text: str) -> str:
    """A setup line writing `text` verbatim (quoted heredoc: no expansion) to `path`.

    `text` must end with a newline unless empty; the heredoc adds nothing else.
    """
    if HEREDOC_END in text:
        raise ValueError("file content contains the heredoc terminator")
    if text and not text.endswith("\n"):
        raise ValueError("write_file: text must end with a newline")
    return f"cat > {path} <<'{HEREDOC_END}'\n{text}{HEREDOC_END}"


def lines(items) -> str:
    """Items joined one per line, with a final newline."""
    return "".join(f"{item}\n" for item in items)


WORDS = (
    "apple",
    "river",
    "stone",
    "cloud",
    "maple",
    "tiger",
    "ocean",
    "piano",
    "lemon",
    "eagle",
    "forest",
    "candle",
    "rocket",
    "silver",
    "garden",
    "window",
    "bridge",
    "planet",
    "orange",
    "violet",
    "thunder",
    "marble",
    "pepper",
    "castle",
    "dragon",
    "falcon",
    "harbor",
    "island",
    "jungle",
    "kettle",
    "lantern",
    "meadow",
    "needle",
    "pillow",
    "quartz",
    "rabbit",
    "saddle",
    "tunnel",
    "valley",
    "walnut",
    "yellow",
    "zebra",
    "anchor",
    "basket",
    "cactus",
    "desert",
    "engine",
    "feather",
    "glacier",
    "hammer",
    "igloo",
    "jacket",
    "koala",
    "ladder",
    "mirror",
    "nickel",
    "oyster",
    "parrot",
    "quiver",
    "ribbon",
    "salmon",
    "turtle",
    "umbrella",
    "velvet",
    "wizard",
    "yogurt",
    "acorn",
    "blossom",
    "copper",
    "dolphin",
    "ember",
    "fossil",
    "granite",
    "horizon",
    "indigo",
    "jasmine",
    "kernel",
    "lizard",
    "magnet",
    "nectar",
    "orchid",
    "pebble",
    "quill",
    "raven",
    "sparrow",
    "timber",
    "urchin",
    "vessel",
    "willow",
    "badger",
    "cobalt",
    "dune",
    "fern",
    "goblet",
    "hazel",
    "ivory",
    "juniper",
    "lotus",
    "mango",
    "nutmeg",
    "onyx",
)

NAMES = (
    "alice",
    "bob",
    "carol",
    "dave",
    "erin",
    "frank",
    "grace",
    "heidi",
    "ivan",
    "judy",
    "kevin",
    "laura",
    "mallory",
    "nina",
    "oscar",
    "peggy",
    "quinn",
    "rupert",
    "sybil",
    "trent",
    "ursula",
    "victor",
    "wendy",
)

FILE_STEMS = (
    "data",
    "notes",
    "records",
    "items",
    "list",
    "inventory",
    "log",
    "entries",
    "report",
    "words",
    "values",
    "names",
    "catalog",
    "journal",
    "todo",
    "input",
    "sample",
    "draft",
    "memo",
    "ledger",
)


def pick_words(rng: random.Random, n: int, *, distinct: bool = False) -> list[str]:
    return rng.sample(WORDS, n) if distinct else [rng.choice(WORDS) for _ in range(n)]
