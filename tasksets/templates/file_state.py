"""Training templates graded on the end state of the workspace (kind "file_state"): write a file,
replace a word in place, make a script executable, create a tar archive, create nested
directories. The expected state is computed here in Python from the values the template chose.
Registered (name, difficulty, kind) in the package's __init__.py.
"""

from __future__ import annotations

import hashlib
import random

from tasksets.instances import (
    FILE_STEMS,
    WORDS,
    Instance,
    lines,
    pick_words,
    write_file,
)


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


def mkdir_nested(rng: random.Random) -> Instance:
    path = "/".join(pick_words(rng, 3, distinct=True))
    return Instance(
        f"Create the directory {path} (with all its parent directories).",
        "",
        [{"type": "file_exists", "path": path, "directory": True}],
        f"mkdir -p {path}",
        "done",
    )
