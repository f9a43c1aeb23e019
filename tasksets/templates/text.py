"""Training templates over the text of one file: count lines, words, matches and distinct words,
read a value or a line, rank words by frequency. Graded on the final answer, which is computed
here in Python from the values the template chose.
Registered (name, difficulty, kind) in the package's __init__.py.
"""

from __future__ import annotations

import random

from tasksets.instances import (
    FILE_STEMS,
    NAMES,
    WORDS,
    Instance,
    lines,
    pick_words,
    write_file,
)
from tasksets.templates.checks import answer_equals, answer_integer_equals


def count_lines(rng: random.Random) -> Instance:
    name = f"{rng.choice(FILE_STEMS)}.txt"
    n = rng.randint(3, 40)
    text = lines(" ".join(pick_words(rng, rng.randint(1, 4))) for _ in range(n))
    return Instance(
        f"How many lines does the file {name} contain? Answer with just the number.",
        write_file(name, text),
        [answer_integer_equals(n)],
        f"wc -l < {name}",
        str(n + 1),
    )


def read_config_value(rng: random.Random) -> Instance:
    keys = rng.sample(
        (
            "host",
            "port",
            "user",
            "mode",
            "level",
            "color",
            "region",
            "timeout",
            "retries",
            "theme",
            "language",
            "owner",
            "backup",
            "cache",
            "queue",
        ),
        rng.randint(4, 9),
    )
    values = {
        k: (str(rng.randint(1, 9999)) if rng.random() < 0.5 else rng.choice(WORDS)) for k in keys
    }
    key = rng.choice(keys)
    text = lines(f"{k}={v}" for k, v in values.items())
    wrong = (
        next(v for k, v in values.items() if v != values[key])
        if len(set(values.values())) > 1
        else "unknown"
    )
    return Instance(
        f"The file settings.conf has lines of the form key=value. What is the value of the key "
        f"'{key}'? Answer with just the value.",
        write_file("settings.conf", text),
        [answer_equals(values[key])],
        f"grep '^{key}=' settings.conf | cut -d= -f2-",
        wrong,
    )


def line_n(rng: random.Random) -> Instance:
    name = f"{rng.choice(FILE_STEMS)}.txt"
    n = rng.randint(4, 20)
    rows = [f"{w} {rng.randint(10, 999)}" for w in pick_words(rng, n)]
    rows = list(dict.fromkeys(rows))  # unique lines
    k = rng.randint(1, len(rows))
    wrong = rows[k % len(rows)] if len(rows) > 1 else "none"
    return Instance(
        f"What is line number {k} of the file {name}? Answer with the exact text of that line.",
        write_file(name, lines(rows)),
        [answer_equals(rows[k - 1])],
        f"sed -n '{k}p' {name}",
        wrong,
    )


def word_count(rng: random.Random) -> Instance:
    name = f"{rng.choice(FILE_STEMS)}.txt"
    rows = [" ".join(pick_words(rng, rng.randint(1, 7))) for _ in range(rng.randint(2, 12))]
    total = sum(len(r.split()) for r in rows)
    return Instance(
        f"How many words are in the file {name}? Words are separated by spaces or newlines. "
        "Answer with just the number.",
        write_file(name, lines(rows)),
        [answer_integer_equals(total)],
        f"wc -w < {name}",
        str(total + 2),
    )


def grep_count(rng: random.Random) -> Instance:
    levels = ("INFO", "WARN", "ERROR", "DEBUG")
    n = rng.randint(8, 40)
    rows = [(rng.choice(levels), rng.choice(WORDS), rng.randint(1, 500)) for _ in range(n)]
    level = rng.choice(levels)
    count = sum(1 for lv, _, _ in rows if lv == level)
    text = lines(
        f"2024-03-{1 + i % 28:02d} 12:{i % 60:02d}:00 {lv} {w} id={x}"
        for i, (lv, w, x) in enumerate(rows)
    )
    return Instance(
        f"How many lines of the file app.log contain the word {level}? Answer with just the number.",
        write_file("app.log", text),
        [answer_integer_equals(count)],
        f"grep -c {level} app.log",
        str(count + 1),
    )


def count_unique(rng: random.Random) -> Instance:
    name = f"{rng.choice(FILE_STEMS)}.txt"
    pool = pick_words(rng, rng.randint(3, 12), distinct=True)
    rows = pool + [rng.choice(pool) for _ in range(rng.randint(2, 20))]
    rng.shuffle(rows)
    distinct = len(set(rows))
    return Instance(
        f"The file {name} has one word per line. How many distinct words does it contain? "
        "Answer with just the number.",
        write_file(name, lines(rows)),
        [answer_integer_equals(distinct)],
        f"sort -u {name} | wc -l",
        str(len(rows)),
    )


def most_frequent(rng: random.Random) -> Instance:
    name = f"{rng.choice(FILE_STEMS)}.txt"
    pool = pick_words(rng, rng.randint(3, 7), distinct=True)
    counts = {w: rng.randint(1, 6) for w in pool}
    top = pool[0]
    counts[top] = max(counts.values()) + rng.randint(1, 3)  # a unique maximum
    rows = [w for w, c in counts.items() for _ in range(c)]
    rng.shuffle(rows)
    return Instance(
        f"The file {name} has one word per line. Which word appears most often? "
        "Answer with just that word.",
        write_file(name, lines(rows)),
        [answer_equals(top)],
        f"sort {name} | uniq -c | sort -rn | head -1 | awk '{{print $2}}'",
        pool[1],
    )


def count_matching_users(rng: random.Random) -> Instance:
    people = rng.sample(NAMES, rng.randint(4, 12))
    teams = {p: rng.choice(("red", "blue", "green")) for p in people}
    team = rng.choice(sorted(set(teams.values())))
    count = sum(1 for t in teams.values() if t == team)
    text = lines(f"{p} {t}" for p, t in teams.items())
    return Instance(
        f"Each line of team.txt has a person's name and a team color. How many people are in the "
        f"{team} team? Answer with just the number.",
        write_file("team.txt", text),
        [answer_integer_equals(count)],
        f"grep -c ' {team}$' team.txt",
        str(count + 1),
    )


def top_words(rng: random.Random) -> Instance:
    name = f"{rng.choice(FILE_STEMS)}.txt"
    pool = pick_words(rng, rng.randint(4, 7), distinct=True)
    counts = rng.sample(range(1, 12), len(pool))  # distinct counts: an unambiguous order
    rows = [w for w, c in zip(pool, counts) for _ in range(c)]
    rng.shuffle(rows)
    top = [w for _, w in sorted(zip(counts, pool), reverse=True)[:3]]
    return Instance(
        f"The file {name} has one word per line. Which three words appear most often? Answer with "
        "the three words separated by single spaces, the most frequent first.",
        write_file(name, lines(rows)),
        [answer_equals(" ".join(top))],
        f"sort {name} | uniq -c | sort -rn | head -3 | awk '{{print $2}}' | paste -sd' '",
        " ".join(reversed(top)),
    )


def cat_file(rng: random.Random) -> Instance:
    name = f"{rng.choice(('secret', 'answer', 'code', 'word', 'key', 'token', 'message'))}.txt"
    word, other = pick_words(rng, 2, distinct=True)
    value = f"{word}{rng.randint(10, 999)}"
    return Instance(
        f"The file {name} contains a single word. What is that word? Answer with just the word.",
        write_file(name, lines([value])),
        [answer_equals(value)],
        f"cat {name}",
        other,
    )
