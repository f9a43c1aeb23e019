"""Check objects in JSON form (see shellrl.contract.check_from_json) for templates graded on the
final answer."""

from __future__ import annotations


def answer_integer_equals(expected: int) -> dict:
    return {"type": "answer_integer_equals", "expected": expected}


def answer_equals(expected: str, case_insensitive: bool = False) -> dict:
    check = {"type": "answer_equals", "expected": expected}
    if case_insensitive:
        check["case_insensitive"] = True
    return check
