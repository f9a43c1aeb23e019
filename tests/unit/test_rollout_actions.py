"""parse_action: well-formed actions, and every malformed reply named (issue 5, malformed actions)."""

import pytest

from services.rollout.actions import AnswerAction, BashAction, ParseError, parse_action

EOT = "<|im_end|>"


@pytest.mark.parametrize(
    "text, command",
    [
        ("<bash>ls -la</bash>", "ls -la"),
        ("<bash>  wc -l < notes.txt \n</bash><|im_end|>", "wc -l < notes.txt"),
        ("Let me look.\n< bash >cat a.txt</ BASH >", "cat a.txt"),
        ("<bash>grep -c x f\nwc -l f</bash>", "grep -c x f\nwc -l f"),
        ("<bash>echo hi</bash> trailing text after the tag", "echo hi"),
    ],
)
def test_bash_action_is_parsed_tolerant_of_whitespace_and_case(text, command):
    assert parse_action(text, EOT) == BashAction(command)


@pytest.mark.parametrize(
    "text, answer",
    [
        ("<answer>4</answer>", "4"),
        ("<answer>\n  linux \n</answer><|im_end|>", "linux"),
        ("<answer></answer>", ""),
    ],
)
def test_answer_action_is_parsed(text, answer):
    assert parse_action(text, EOT) == AnswerAction(answer)


@pytest.mark.parametrize(
    "text, kind, says",
    [
        ("I think the answer is 4.<|im_end|>", "no_action", "no action found"),
        ("", "no_action", "no action found"),
        ("<bash>ls</bash><bash>pwd</bash>", "two_actions", "more than one action"),
        ("<bash>ls <bash>pwd</bash>", "two_actions", "more than one action"),
        ("<bash>ls</bash><answer>3</answer>", "two_actions", "more than one action"),
        ("<bash>cat notes.txt", "unclosed_tag", "<bash> was not closed with </bash>"),
        ("<answer>4<|im_end|>", "unclosed_tag", "<answer> was not closed with </answer>"),
        ("<bash>ls</answer>", "unclosed_tag", "<bash> was not closed"),
        ("ls -la</bash>", "unopened_tag", "found </bash> without <bash>"),
        ("<bash>   </bash>", "empty_command", "command in <bash></bash> is empty"),
    ],
)
def test_malformed_reply_yields_an_error_that_says_what_was_wrong(text, kind, says):
    action = parse_action(text, EOT)
    assert isinstance(action, ParseError)
    assert action.kind == kind
    assert says in action.message
    assert "<bash>COMMAND</bash>" in action.message  # and how to do it right
