"""Every `shellrl` command's --help stands on its own: it names nothing outside the repository
(a new user found `shellrl submit --help` pointing at ../shared/tasks, which a clone lacks)."""

from __future__ import annotations

import argparse

from cli.main import build_parser


def test_no_command_help_points_outside_the_repository():
    parser = build_parser()
    helps = {"shellrl": parser.format_help()}
    for action in parser._actions:  # argparse keeps the sub-parsers on this action only
        if isinstance(action, argparse._SubParsersAction):
            helps.update({f"shellrl {n}": p.format_help() for n, p in action.choices.items()})
    assert len(helps) > 10
    outside = {
        name: text for name, text in helps.items() if "../shared" in text or "/work/" in text
    }
    assert outside == {}, sorted(outside)
