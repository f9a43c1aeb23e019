"""Training templates over numbers and structured data: shell arithmetic, a CSV column sum, a
field of a JSON file. Graded on the final answer, which is computed here in Python from the values
the template chose.
Registered (name, difficulty, kind) in the package's __init__.py.
"""

from __future__ import annotations

import json
import random

from tasksets.instances import (
    WORDS,
    Instance,
    lines,
    pick_words,
    write_file,
)
from tasksets.templates.checks import answer_equals, answer_integer_equals


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
        [answer_integer_equals(value)],
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
        [answer_integer_equals(total)],
        f"awk -F, 'NR > 1 {{ s += ${index + 1} }} END {{ print s }}' sales.csv",
        str(total - 1),
    )


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
        [answer_equals(value)],
        ref,
        str(doc["version"]) + "0",
    )
