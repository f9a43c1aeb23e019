"""Out-of-distribution templates (split `eval_ood` only; never trained on): compressed input,
permission bits, per-row maxima, JSON aggregation, access logs, case conversion, line lengths,
byte totals, last lines, file sizes. Every expected answer is computed here in Python.
"""

from __future__ import annotations

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


@template("gzip_line_count", "medium", ood=True)
def gzip_line_count(rng: random.Random) -> Instance:
    name = f"{rng.choice(FILE_STEMS)}.txt"
    n = rng.randint(3, 60)
    text = lines(f"{rng.choice(WORDS)} {rng.randint(0, 9999)}" for _ in range(n))
    setup = write_file(name, text) + f"\ngzip -n {name}"
    return Instance(
        f"The file {name}.gz is gzip-compressed. How many lines does its decompressed content have? "
        "Answer with just the number.",
        setup,
        [{"type": "answer_integer_equals", "expected": n}],
        f"zcat {name}.gz | wc -l",
        str(n * 2),
    )


@template("permission_bits", "medium", ood=True)
def permission_bits(rng: random.Random) -> Instance:
    name = f"{rng.choice(('secret', 'private', 'shared', 'public', 'key', 'notes'))}_{rng.randint(1, 99)}.txt"
    mode = rng.choice(("600", "640", "644", "660", "664", "700", "750", "755", "444", "400"))
    setup = f"echo {rng.choice(WORDS)} > {name}\nchmod {mode} {name}"
    wrong = "777" if mode != "777" else "000"
    return Instance(
        f"What are the permission bits of the file {name}, in octal notation such as 644? "
        "Answer with just the three digits.",
        setup,
        [{"type": "answer_equals", "expected": mode}],
        f"stat -c %a {name}",
        wrong,
    )


@template("csv_max_name", "medium", ood=True)
def csv_max_name(rng: random.Random) -> Instance:
    people = rng.sample(NAMES, rng.randint(3, 10))
    scores = dict(zip(people, rng.sample(range(101), len(people))))
    best = max(scores, key=scores.get)
    worst = min(scores, key=scores.get)
    text = lines(["name,score", *(f"{p},{s}" for p, s in scores.items())])
    return Instance(
        "scores.csv is a CSV file with a header line name,score. Which person has the highest score? "
        "Answer with just the name.",
        write_file("scores.csv", text),
        [{"type": "answer_equals", "expected": best}],
        "tail -n +2 scores.csv | sort -t, -k2 -n | tail -1 | cut -d, -f1",
        worst,
    )


@template("json_list_sum", "medium", ood=True)
def json_list_sum(rng: random.Random) -> Instance:
    items = [
        {"name": w, "price": rng.randint(1, 300), "stock": rng.randint(0, 40)}
        for w in pick_words(rng, rng.randint(2, 9), distinct=True)
    ]
    field = rng.choice(("price", "stock"))
    total = sum(i[field] for i in items)
    ref = f"python3 -c \"import json; print(sum(i['{field}'] for i in json.load(open('items.json'))))\""
    return Instance(
        f"items.json holds a JSON list of objects, each with the fields name, price and stock. "
        f"What is the sum of the {field} field over all objects? Answer with just the number.",
        write_file("items.json", json.dumps(items, indent=1) + "\n"),
        [{"type": "answer_integer_equals", "expected": total}],
        ref,
        str(total + 5),
    )


@template("unique_ips", "medium", ood=True)
def unique_ips(rng: random.Random) -> Instance:
    pool = list(
        {f"10.0.{rng.randint(0, 9)}.{rng.randint(1, 254)}" for _ in range(rng.randint(2, 10))}
    )
    n = rng.randint(len(pool), 40)
    rows = pool + [rng.choice(pool) for _ in range(n - len(pool))]
    rng.shuffle(rows)
    text = lines(
        f'{ip} - - [10/Oct/2024:13:{i % 60:02d}:00 +0000] "GET /{rng.choice(WORDS)} HTTP/1.1" '
        f"{rng.choice((200, 404, 500))} {rng.randint(100, 9000)}"
        for i, ip in enumerate(rows)
    )
    return Instance(
        "access.log is a web server log; each line starts with the client's IP address. How many "
        "distinct client IP addresses appear in it? Answer with just the number.",
        write_file("access.log", text),
        [{"type": "answer_integer_equals", "expected": len(pool)}],
        "awk '{print $1}' access.log | sort -u | wc -l",
        str(len(rows)),
    )


@template("uppercase_file", "medium", ood=True, kind="file_state")
def uppercase_file(rng: random.Random) -> Instance:
    text = lines(" ".join(pick_words(rng, rng.randint(1, 5))) for _ in range(rng.randint(1, 6)))
    checks = [
        {"type": "file_exists", "path": "output.txt"},
        {"type": "command_output_equals", "command": "cat output.txt", "expected": text.upper()},
    ]
    return Instance(
        "Write the content of input.txt converted to upper case into a new file output.txt.",
        write_file("input.txt", text),
        checks,
        "tr a-z A-Z < input.txt > output.txt",
        "done",
    )


@template("longest_line", "hard", ood=True)
def longest_line(rng: random.Random) -> Instance:
    name = f"{rng.choice(FILE_STEMS)}.txt"
    rows = [" ".join(pick_words(rng, rng.randint(1, 8))) for _ in range(rng.randint(3, 15))]
    longest = max(len(r) for r in rows)
    return Instance(
        f"What is the length, in characters, of the longest line in the file {name}? "
        "Do not count the newline. Answer with just the number.",
        write_file(name, lines(rows)),
        [{"type": "answer_integer_equals", "expected": longest}],
        f"awk '{{ if (length($0) > m) m = length($0) }} END {{ print m }}' {name}",
        str(longest + 1),
    )


@template("total_bytes", "medium", ood=True)
def total_bytes(rng: random.Random) -> Instance:
    directory = rng.choice(("parts", "chunks", "blobs", "pieces"))
    sizes = [rng.randint(1, 3000) for _ in range(rng.randint(2, 8))]
    setup = f"mkdir {directory}\n" + "\n".join(
        f"head -c {s} /dev/zero > {directory}/part{i}.bin" for i, s in enumerate(sizes)
    )
    return Instance(
        f"What is the total size in bytes of all files in the directory {directory}? "
        "Answer with just the number.",
        setup,
        [{"type": "answer_integer_equals", "expected": sum(sizes)}],
        f"cat {directory}/* | wc -c",
        str(sum(sizes) + 1),
    )


@template("last_line", "easy", ood=True)
def last_line(rng: random.Random) -> Instance:
    name = f"{rng.choice(FILE_STEMS)}.log"
    rows = list(
        dict.fromkeys(f"{w} {rng.randint(100, 999)}" for w in pick_words(rng, rng.randint(3, 15)))
    )
    wrong = rows[0] if len(rows) > 1 else "none"
    return Instance(
        f"What is the last line of the file {name}? Answer with the exact text of that line.",
        write_file(name, lines(rows)),
        [{"type": "answer_equals", "expected": rows[-1]}],
        f"tail -n 1 {name}",
        wrong,
    )


@template("file_size_bytes", "easy", ood=True)
def file_size_bytes(rng: random.Random) -> Instance:
    name = f"{rng.choice(FILE_STEMS)}.txt"
    text = lines(" ".join(pick_words(rng, rng.randint(1, 6))) for _ in range(rng.randint(1, 8)))
    size = len(text.encode())
    return Instance(
        f"What is the size of the file {name} in bytes? Answer with just the number.",
        write_file(name, text),
        [{"type": "answer_integer_equals", "expected": size}],
        f"wc -c < {name}",
        str(size - 1),
    )
