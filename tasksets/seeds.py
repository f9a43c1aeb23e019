"""The four tasks of the seed write-up, as built-ins (split `train`, source `shellrl:seeds`).

Decisions stated in the task text itself, so that the label is unambiguous:
* seed-sha256: the digest of the 13 bytes `nano_miles_rl` WITHOUT a trailing newline
  (`printf %s nano_miles_rl | sha256sum`). `echo nano_miles_rl | sha256sum` hashes 14 bytes and
  is a wrong answer. Hex case is ignored (the digest is the same number).
* seed-uname: the expected answer is `linux`: the sandbox runs commands on the Linux kernel,
  whose `uname -s` is `Linux`; the check is case-sensitive, so `Linux` is wrong.
"""

from __future__ import annotations

import hashlib

from shellrl.contract import Task, task_from_json

SOURCE = "shellrl:seeds"
SHA256_INPUT = "nano_miles_rl"
SHA256_EXPECTED = hashlib.sha256(SHA256_INPUT.encode()).hexdigest()
SHA256_WITH_NEWLINE = hashlib.sha256((SHA256_INPUT + "\n").encode()).hexdigest()
PRODUCT_FACTORS = (1234, 5678)

SEED_TASKS_JSON: list[dict] = [
    {
        "task_id": "seed-sha256",
        "instruction": (
            f"Compute the SHA-256 hash of the string {SHA256_INPUT} (exactly these 13 characters, "
            "without a trailing newline) and answer with the hex digest."
        ),
        "setup": "",
        "check": {"type": "answer_equals", "expected": SHA256_EXPECTED, "case_insensitive": True},
        "reference_solution": f"printf '%s' {SHA256_INPUT} | sha256sum | cut -d' ' -f1",
        "tags": ["seed", "difficulty:medium", "answer"],
    },
    {
        "task_id": "seed-numbers",
        "instruction": (
            "Write the numbers 1 to 5, one per line, into a file named numbers.txt. Then count the "
            "lines of numbers.txt and answer with the count."
        ),
        "setup": "",
        "check": [
            {"type": "answer_integer_equals", "expected": 5},
            {"type": "file_exists", "path": "numbers.txt"},
            {
                "type": "command_output_equals",
                "command": "cat numbers.txt",
                "expected": "1\n2\n3\n4\n5",
            },
        ],
        "reference_solution": "seq 1 5 > numbers.txt\nwc -l < numbers.txt",
        "tags": ["seed", "difficulty:easy", "answer", "file_state"],
    },
    {
        "task_id": "seed-uname",
        "instruction": "What is the name of the kernel as printed by `uname -s`? Answer with it in lowercase.",
        "setup": "",
        "check": {"type": "answer_equals", "expected": "linux"},
        "reference_solution": "uname -s | tr '[:upper:]' '[:lower:]'",
        "tags": ["seed", "difficulty:easy", "answer"],
    },
    {
        "task_id": "seed-product",
        "instruction": (
            f"Use python3 -c to compute the product {PRODUCT_FACTORS[0]} * {PRODUCT_FACTORS[1]} and "
            "answer with the result."
        ),
        "setup": "",
        "check": {
            "type": "answer_integer_equals",
            "expected": PRODUCT_FACTORS[0] * PRODUCT_FACTORS[1],
        },
        "reference_solution": f"python3 -c 'print({PRODUCT_FACTORS[0]} * {PRODUCT_FACTORS[1]})'",
        "tags": ["seed", "difficulty:easy", "answer"],
    },
]

WRONG_ANSWERS = {
    "seed-sha256": SHA256_WITH_NEWLINE,
    "seed-numbers": "6",
    "seed-uname": "Linux",
    "seed-product": str(PRODUCT_FACTORS[0] * PRODUCT_FACTORS[1] + 1),
}
"""The typical wrong answer of each seed task (used by validation and tests)."""


def seed_tasks() -> list[Task]:
    """The four seed tasks as validated `Task`s."""
    return [task_from_json({**t, "split": "train", "source": SOURCE}) for t in SEED_TASKS_JSON]
