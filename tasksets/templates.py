"""Training templates (splits `train` and `eval_id`): files, text processing, archives,
permissions, find, checksums, arithmetic and JSON. Easy ones first: a 135M model should solve
some of them sometimes (count lines of a file, read a value, shell arithmetic).

Every expected answer is computed here in Python from the values the template chose.
"""

from __future__ import annotations

import hashlib
import json
import random

from tasksets.instances import (
    FILE_STEMS,
    NAMES,
    WORDS,
    Instance,
    lines,
    pick_words,
    template,
    write_file,
)


def _integer(expected: int) -> dict:
    return {"type": "answer_integer_equals", "expected": expected}


def _text(expected: str, case_insensitive: bool = False) -> dict:
    check = {"type": "answer_equals", "expected": expected}
    if case_insensitive:
        check["case_insensitive"] = True
    return check


@template("count_lines", "easy")
def count_lines(rng: random.Random) -> Instance:
    name = f"{rng.choice(FILE_STEMS)}.txt"
    n = rng.randint(3, 40)
    text = lines(" ".join(pick_words(rng, rng.randint(1, 4))) for _ in range(n))
    return Instance(
        f"How many lines does the file {name} contain? Answer with just the number.",
        write_file(name, text),
        [_integer(n)],
        f"wc -l < {name}",
        str(n + 1),
    )


@template("read_config_value", "easy")
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
        [_text(values[key])],
        f"grep '^{key}=' settings.conf | cut -d= -f2-",
        wrong,
    )


@template("shell_arithmetic", "easy")
def shell_arithmetic(rng: random.Random) -> Instance:
    a, b, c = rng.randint(2, 999), rng.randint(2, 99), rng.randint(1, 500)
    form = rng.choice(
        (
            "{a} + {b}",
            "{a} * {b}",
            "{a} * {b} + {c}",
            "{a} * {b} - {c}",
            "({a} + {c}) * {b}",
            "{a} - {b} - {c}",
        )
    )
    expression = form.format(a=a, b=b, c=c)
    value = _eval_arithmetic(form, a, b, c)
    return Instance(
        f"Use the shell to compute {expression} and answer with the result as a number.",
        "",
        [_integer(value)],
        f"echo $(( {expression} ))",
        str(value + 10),
    )


def _eval_arithmetic(form: str, a: int, b: int, c: int) -> int:
    return {
        "{a} + {b}": a + b,
        "{a} * {b}": a * b,
        "{a} * {b} + {c}": a * b + c,
        "{a} * {b} - {c}": a * b - c,
        "({a} + {c}) * {b}": (a + c) * b,
        "{a} - {b} - {c}": a - b - c,
    }[form]


@template("count_files", "easy")
def count_files(rng: random.Random) -> Instance:
    directory = rng.choice(("inbox", "photos", "reports", "uploads", "archive", "docs", "drafts"))
    n = rng.randint(2, 25)
    files = [
        f"{w}_{i}.{rng.choice(('txt', 'md', 'csv', 'dat'))}"
        for i, w in enumerate(pick_words(rng, n))
    ]
    setup = f"mkdir {directory}\n" + "\n".join(
        f"echo {rng.randint(0, 99)} > {directory}/{f}" for f in files
    )
    return Instance(
        f"How many files are in the directory {directory}? Answer with just the number.",
        setup,
        [_integer(n)],
        f"ls {directory} | wc -l",
        str(n - 1),
    )


@template("line_n", "easy")
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
        [_text(rows[k - 1])],
        f"sed -n '{k}p' {name}",
        wrong,
    )


@template("word_count", "easy")
def word_count(rng: random.Random) -> Instance:
    name = f"{rng.choice(FILE_STEMS)}.txt"
    rows = [" ".join(pick_words(rng, rng.randint(1, 7))) for _ in range(rng.randint(2, 12))]
    total = sum(len(r.split()) for r in rows)
    return Instance(
        f"How many words are in the file {name}? Words are separated by spaces or newlines. "
        "Answer with just the number.",
        write_file(name, lines(rows)),
        [_integer(total)],
        f"wc -w < {name}",
        str(total + 2),
    )


@template("grep_count", "medium")
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
        [_integer(count)],
        f"grep -c {level} app.log",
        str(count + 1),
    )


@template("count_unique", "medium")
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
        [_integer(distinct)],
        f"sort -u {name} | wc -l",
        str(len(rows)),
    )


@template("most_frequent", "medium")
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
        [_text(top)],
        f"sort {name} | uniq -c | sort -rn | head -1 | awk '{{print $2}}'",
        pool[1],
    )


@template("csv_column_sum", "medium")
def csv_column_sum(rng: random.Random) -> Instance:
    items = pick_words(rng, rng.randint(3, 12), distinct=True)
    rows = [(item, rng.randint(1, 50), rng.randint(1, 200)) for item in items]
    column, index = rng.choice((("quantity", 1), ("price", 2)))
    total = sum(r[index] for r in rows)
    text = lines(["item,quantity,price", *(f"{a},{b},{c}" for a, b, c in rows)])
    return Instance(
        f"sales.csv is a CSV file with a header line item,quantity,price. What is the sum of the "
        f"{column} column over all rows? Answer with just the number.",
        write_file("sales.csv", text),
        [_integer(total)],
        f"awk -F, 'NR > 1 {{ s += ${index + 1} }} END {{ print s }}' sales.csv",
        str(total - 1),
    )


@template("write_text_file", "easy", kind="file_state")
def write_text_file(rng: random.Random) -> Instance:
    name = f"{rng.choice(FILE_STEMS)}.txt"
    text = " ".join(pick_words(rng, rng.randint(2, 4)))
    checks = [
        {"type": "file_exists", "path": name},
        {"type": "command_output_equals", "command": f"cat {name}", "expected": text},
    ]
    return Instance(
        f"Create a file named {name} whose content is exactly this line: {text}",
        "",
        checks,
        f"echo '{text}' > {name}",
        text,
    )


@template("replace_word", "medium", kind="file_state")
def replace_word(rng: random.Random) -> Instance:
    pool = pick_words(rng, 8, distinct=True)
    old, new = pool[0], pool[1]
    others = [w for w in pool[2:] if old not in w]
    rows = [
        " ".join(rng.choice([old, *others]) for _ in range(rng.randint(2, 6)))
        for _ in range(rng.randint(3, 8))
    ]
    if not any(old in r for r in rows):
        rows[0] += f" {old}"
    text = lines(rows)
    expected = text.replace(old, new)
    checks = [
        {
            "type": "file_sha256",
            "path": "notes.txt",
            "sha256": hashlib.sha256(expected.encode()).hexdigest(),
        }
    ]
    return Instance(
        f"In the file notes.txt, replace every occurrence of the word '{old}' with '{new}'. "
        "Edit the file in place and change nothing else.",
        write_file("notes.txt", text),
        checks,
        f"sed -i 's/{old}/{new}/g' notes.txt",
        "done",
    )


@template("make_executable", "easy", kind="file_state")
def make_executable(rng: random.Random) -> Instance:
    name = f"{rng.choice(('run', 'build', 'deploy', 'start', 'check', 'backup'))}.sh"
    body = f"#!/bin/sh\necho {rng.choice(WORDS)} {rng.randint(1, 99)}\n"
    checks = [
        {"type": "command_exit_code", "command": f"test -x {name}", "exit_code": 0},
        {"type": "file_sha256", "path": name, "sha256": hashlib.sha256(body.encode()).hexdigest()},
    ]
    return Instance(
        f"Make the script {name} executable. Do not change its content.",
        write_file(name, body) + f"\nchmod 644 {name}",
        checks,
        f"chmod +x {name}",
        "done",
    )


@template("tar_directory", "medium", kind="file_state")
def tar_directory(rng: random.Random) -> Instance:
    directory = rng.choice(("project", "website", "notes", "configs", "photos", "thesis"))
    n = rng.randint(2, 8)
    files = [f"{w}.txt" for w in pick_words(rng, n, distinct=True)]
    archive = f"{rng.choice(('backup', 'bundle', 'snapshot', 'export'))}.tar.gz"
    setup = f"mkdir {directory}\n" + "\n".join(
        f"echo {rng.choice(WORDS)} > {directory}/{f}" for f in files
    )
    checks = [
        {"type": "file_exists", "path": archive},
        {
            "type": "command_output_equals",
            "command": f"tar -tzf {archive} | grep -c '\\.txt$'",
            "expected": str(n),
        },
    ]
    return Instance(
        f"Create a gzip-compressed tar archive named {archive} that contains the directory "
        f"{directory} with all its files.",
        setup,
        checks,
        f"tar -czf {archive} {directory}",
        "done",
    )


@template("find_by_extension", "medium")
def find_by_extension(rng: random.Random) -> Instance:
    extensions = ("log", "txt", "csv", "py", "md")
    dirs = [
        "project",
        *(f"project/{d}" for d in rng.sample(("src", "docs", "data", "tmp", "lib"), 3)),
    ]
    dirs.append(f"{dirs[1]}/{rng.choice(('old', 'new', 'misc'))}")
    files = {
        f"{rng.choice(dirs)}/{w}_{i}.{rng.choice(extensions)}"
        for i, w in enumerate(pick_words(rng, rng.randint(5, 20)))
    }
    ext = rng.choice(extensions)
    count = sum(1 for f in files if f.endswith(f".{ext}"))
    setup = "mkdir -p " + " ".join(dirs) + "\n" + "\n".join(f"echo x > {f}" for f in sorted(files))
    return Instance(
        f"How many files with the extension .{ext} are inside the directory project, including all "
        "of its subdirectories? Answer with just the number.",
        setup,
        [_integer(count)],
        f"find project -type f -name '*.{ext}' | wc -l",
        str(count + 1),
    )


@template("file_checksum", "medium")
def file_checksum(rng: random.Random) -> Instance:
    name = f"{rng.choice(FILE_STEMS)}.{rng.choice(('txt', 'dat', 'bin'))}"
    text = lines(" ".join(pick_words(rng, 3)) for _ in range(rng.randint(1, 5)))
    digest = hashlib.sha256(text.encode()).hexdigest()
    return Instance(
        f"What is the SHA-256 checksum of the file {name}? Answer with just the hex digest.",
        write_file(name, text),
        [_text(digest, case_insensitive=True)],
        f"sha256sum {name} | cut -d' ' -f1",
        hashlib.sha256(text.encode() + b"\n").hexdigest(),
    )


@template("json_field", "medium")
def json_field(rng: random.Random) -> Instance:
    section = rng.choice(("server", "database", "cache", "client"))
    fields = {
        "port": rng.randint(1024, 65535),
        "host": f"{rng.choice(WORDS)}.example.com",
        "workers": rng.randint(1, 64),
        "name": rng.choice(WORDS),
    }
    doc = {"version": rng.randint(1, 9), section: fields, "debug": rng.choice((True, False))}
    key = rng.choice(list(fields))
    value = str(fields[key])
    text = json.dumps(doc, indent=2) + "\n"
    ref = f"python3 -c \"import json; print(json.load(open('config.json'))['{section}']['{key}'])\""
    return Instance(
        f'config.json is a JSON file. What is the value of the field "{key}" inside the '
        f'"{section}" object? Answer with just the value.',
        write_file("config.json", text),
        [_text(value)],
        ref,
        str(doc["version"]) + "0",
    )


@template("largest_file", "medium")
def largest_file(rng: random.Random) -> Instance:
    directory = rng.choice(("downloads", "media", "cache", "output"))
    names = [f"{w}.dat" for w in pick_words(rng, rng.randint(3, 7), distinct=True)]
    sizes = rng.sample(range(10, 5000), len(names))
    setup = f"mkdir {directory}\n" + "\n".join(
        f"head -c {s} /dev/zero > {directory}/{n}" for n, s in zip(names, sizes)
    )
    largest = names[sizes.index(max(sizes))]
    smallest = names[sizes.index(min(sizes))]
    return Instance(
        f"Which file in the directory {directory} is the largest (in bytes)? "
        "Answer with just its file name.",
        setup,
        [_text(largest)],
        f"ls -S {directory} | head -1",
        smallest,
    )


@template("mkdir_nested", "easy", kind="file_state")
def mkdir_nested(rng: random.Random) -> Instance:
    path = "/".join(pick_words(rng, 3, distinct=True))
    return Instance(
        f"Create the directory {path} (with all its parent directories).",
        "",
        [{"type": "file_exists", "path": path, "directory": True}],
        f"mkdir -p {path}",
        "done",
    )


@template("count_matching_users", "easy")
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
        [_integer(count)],
        f"grep -c ' {team}$' team.txt",
        str(count + 1),
    )


@template("archive_sum", "hard")
def archive_sum(rng: random.Random) -> Instance:
    archive = f"{rng.choice(('numbers', 'readings', 'counts', 'samples'))}.tar.gz"
    files = {
        f"{w}.txt": [rng.randint(1, 99) for _ in range(rng.randint(1, 5))]
        for w in pick_words(rng, rng.randint(2, 5), distinct=True)
    }
    total = sum(sum(v) for v in files.values())
    setup = "mkdir src\n" + "\n".join(
        write_file(f"src/{name}", lines(v)) for name, v in files.items()
    )
    setup += f"\ntar -czf {archive} -C src .\nrm -r src"
    return Instance(
        f"The archive {archive} holds text files with one number per line. What is the sum of all "
        "the numbers in all files of the archive? Answer with just the number.",
        setup,
        [_integer(total)],
        f"mkdir -p extracted && tar -xzf {archive} -C extracted && "
        "cat extracted/*.txt | awk '{ s += $1 } END { print s }'",
        str(total + 3),
    )


@template("top_words", "hard")
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
        [_text(" ".join(top))],
        f"sort {name} | uniq -c | sort -rn | head -3 | awk '{{print $2}}' | paste -sd' '",
        " ".join(reversed(top)),
    )


@template("cat_file", "easy")
def cat_file(rng: random.Random) -> Instance:
    name = f"{rng.choice(('secret', 'answer', 'code', 'word', 'key', 'token', 'message'))}.txt"
    word, other = pick_words(rng, 2, distinct=True)
    value = f"{word}{rng.randint(10, 999)}"
    return Instance(
        f"The file {name} contains a single word. What is that word? Answer with just the word.",
        write_file(name, lines([value])),
        [_text(value)],
        f"cat {name}",
        other,
    )
