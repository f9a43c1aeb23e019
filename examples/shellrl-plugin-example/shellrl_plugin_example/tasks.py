"""A task source (entry point group `shellrl.tasksets`): `shellrl run --train-set palindromes`
or `load_taskset("palindromes", "train")`. Tasks in the JSON form of the task files; the plug-in's
own check type grades them."""

from __future__ import annotations

import random

WORDS = ("level", "rotor", "kayak", "stats", "refer", "civic", "radar", "madam")


def palindromes(split: str | None, seed: int) -> list[dict]:
    rng = random.Random(seed)
    tasks = []
    for split_name, words in (("train", WORDS[:6]), ("eval_id", WORDS[6:])):
        if split not in (None, split_name):
            continue
        for word in words:
            scrambled = "".join(rng.sample(word, len(word)))
            tasks.append(
                {
                    "task_id": f"palindrome-{split_name}-{word}",
                    "instruction": f"The file letters.txt holds the letters {scrambled!r}. "
                    "Answer with a palindrome that uses all of them.",
                    "setup": f"printf '%s\\n' {scrambled} > letters.txt",
                    "check": {"type": "answer_is_palindrome", "min_length": len(word)},
                    "split": split_name,
                    "template": "palindrome",
                    "source": "shellrl-plugin-example",
                }
            )
    return tasks
