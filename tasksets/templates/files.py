"""Training templates over the file system: count files, find by extension, the largest file, a
checksum, numbers inside a tar archive. Graded on the final answer, which is computed here in
Python from the values the template chose.
Registered (name, difficulty, kind) in the package's __init__.py.
"""

from __future__ import annotations

import hashlib
import random

from tasksets.instances import (
    FILE_STEMS,
    Instance,
    lines,
    pick_words,
    write_file,
)
from tasksets.templates.checks import answer_equals, answer_integer_equals


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
        [answer_integer_equals(n)],
        f"ls {directory} | wc -l",
        str(n - 1),
    )


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
        [answer_integer_equals(count)],
        f"find project -type f -name '*.{ext}' | wc -l",
        str(count + 1),
    )


def file_checksum(rng: random.Random) -> Instance:
    name = f"{rng.choice(FILE_STEMS)}.{rng.choice(('txt', 'dat', 'bin'))}"
    text = lines(" ".join(pick_words(rng, 3)) for _ in range(rng.randint(1, 5)))
    digest = hashlib.sha256(text.encode()).hexdigest()
    return Instance(
        f"What is the SHA-256 checksum of the file {name}? Answer with just the hex digest.",
        write_file(name, text),
        [answer_equals(digest, case_insensitive=True)],
        f"sha256sum {name} | cut -d' ' -f1",
        hashlib.sha256(text.encode() + b"\n").hexdigest(),
    )


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
        [answer_equals(largest)],
        f"ls -S {directory} | head -1",
        smallest,
    )


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
        [answer_integer_equals(total)],
        f"mkdir -p extracted && tar -xzf {archive} -C extracted && "
        "cat extracted/*.txt | awk '{ s += $1 } END { print s }'",
        str(total + 3),
    )
