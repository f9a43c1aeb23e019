"""Checks shared by the commands that start a stack beyond their typed options (cli/options.py):
the tracker's package."""

from __future__ import annotations


def check_tracker(tracker: str) -> None:
    """Raise CliError (before anything starts) when `tracker`'s package is not installed."""
    from cli.errors import CliError
    from shellrl.tracking import PACKAGES, installed

    if tracker in PACKAGES and not installed(tracker):
        raise CliError(f"--tracker {tracker}: pip install {PACKAGES[tracker]}")
