"""Parse the agent's reply of one turn into an action.

Consumes the decoded text of one turn's ACTION tokens (all segments of the turn, special tokens
included) and produces a `BashAction`, an `AnswerAction` or a `ParseError`. The parse never
changes tokens: it only decides what to do next and what the observation says (DESIGN.md
section 7). Tolerant of whitespace and case inside tags (`< bash >`, `</ BASH>`); text before the
tag is allowed; text after the first closed tag is ignored unless it holds another action tag.

Malformed replies, each an observation that says what was wrong (the episode continues):
  no tag at all, two action tags in one turn, an opening tag without its closing tag,
  a closing tag without its opening tag, an empty command.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_OPEN = re.compile(r"<\s*(bash|answer)\s*>", re.IGNORECASE)
_CLOSE = re.compile(r"<\s*/\s*(bash|answer)\s*>", re.IGNORECASE)

FORMAT_HINT = (
    "Reply with <bash>COMMAND</bash> to run one command, or <answer>ANSWER</answer> to finish."
)


@dataclass(frozen=True)
class BashAction:
    command: str


@dataclass(frozen=True)
class AnswerAction:
    answer: str


@dataclass(frozen=True)
class ParseError:
    """`kind`: no_action | two_actions | unclosed_tag | unopened_tag | empty_command (a metric label)."""

    kind: str
    message: str


Action = BashAction | AnswerAction | ParseError


def parse_action(text: str, end_of_turn: str = "") -> Action:
    """One turn's decoded text -> the action it asks for.

    `end_of_turn`: the template's end-of-turn text (e.g. `<|im_end|>`), removed from the end.
    """
    if end_of_turn:
        text = text.replace(end_of_turn, "")
    opens = list(_OPEN.finditer(text))
    if not opens:
        close = _CLOSE.search(text)
        if close:
            tag = close.group(1).lower()
            return ParseError(
                "unopened_tag", f"error: found </{tag}> without <{tag}>. {FORMAT_HINT}"
            )
        return ParseError("no_action", f"error: no action found. {FORMAT_HINT}")
    first = opens[0]
    tag = first.group(1).lower()
    close = next((c for c in _CLOSE.finditer(text, first.end()) if c.group(1).lower() == tag), None)
    if close is None:
        return ParseError(
            "unclosed_tag", f"error: <{tag}> was not closed with </{tag}>. {FORMAT_HINT}"
        )
    if len(opens) > 1:
        return ParseError(
            "two_actions",
            f"error: more than one action in one reply; give exactly one. {FORMAT_HINT}",
        )
    body = text[first.end() : close.start()]
    if tag == "answer":
        return AnswerAction(body.strip())
    command = body.strip()
    if not command:
        return ParseError(
            "empty_command", f"error: the command in <bash></bash> is empty. {FORMAT_HINT}"
        )
    return BashAction(command)
