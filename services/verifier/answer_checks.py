"""The answer checks: pure functions of the agent's final answer (docs/checks.md). Each returns
(passed, detail). `norm` is the normalisation every text comparison of the verifier uses.
"""

from __future__ import annotations

import re

import regex

INTEGER = re.compile(r"[+-]?[0-9]+")
REGEX_FLAGS = regex.VERSION0  # the `re`-compatible dialect of the regex module


def norm(text: str) -> str:
    """CRLF, then CR, become LF; then surrounding whitespace is stripped (../shared/tasks/README.md)."""
    return text.replace("\r\n", "\n").replace("\r", "\n").strip()


def short(text: str, n: int = 80) -> str:
    """`text` for a check's detail: its repr, cut after `n` characters."""
    return repr(text if len(text) <= n else text[:n] + "…")


def answer_equals(answer: str, expected: str, case_insensitive: bool = False) -> tuple[bool, str]:
    """norm(answer) == norm(expected); with case_insensitive both are casefolded first."""
    a, e = norm(answer), norm(expected)
    if case_insensitive:
        a, e = a.casefold(), e.casefold()
    return (a == e), (
        "equal" if a == e else f"answer {short(norm(answer))} != expected {short(norm(expected))}"
    )


def answer_integer_equals(answer: str, expected: int) -> tuple[bool, str]:
    """answer.strip() is `[+-]?[0-9]+` (ASCII digits, no `_`, no spaces inside) and equals expected."""
    text = answer.strip()
    if not INTEGER.fullmatch(text):
        return False, f"answer {short(text)} is not an integer"
    # compare digits, not int(text): Python refuses int() of more than 4300 digits (ValueError)
    negative = text.startswith("-")
    digits = text.lstrip("+-").lstrip("0") or "0"
    equal = digits == str(abs(expected)) and (digits == "0" or negative == (expected < 0))
    return equal, f"{short(text)} {'==' if equal else '!='} {expected}"


def answer_matches(
    answer: str, pattern: str, case_insensitive: bool, timeout_s: float
) -> tuple[bool, str]:
    """norm(answer) is a FULL match of `pattern` (regex, `re` syntax). A match that runs past
    `timeout_s` fails."""
    flags = REGEX_FLAGS | (regex.IGNORECASE if case_insensitive else 0)
    try:
        found = regex.fullmatch(
            pattern, norm(answer), flags=flags, timeout=timeout_s, concurrent=True
        )
    except TimeoutError:
        return False, f"regex ran past {timeout_s:g} s"
    return (
        found is not None,
        "full match" if found else f"answer {short(norm(answer))} does not fully match",
    )
