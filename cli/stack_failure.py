"""Why a local stack did not start: `StackError` and the last error line of a service's log.

cli/launcher.py raises StackError naming the service, its log file and `last_error_line` of it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cli.errors import CliError


class StackError(CliError, RuntimeError):
    """The stack could not start (a port in use, a service that exited or never got ready); the
    message names the service, its log file and the log's last error line. Exit status 1."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_status=1)


def last_error_line(log_path: Path, tail_bytes: int = 64 * 1024) -> str | None:
    """The last line of a service log that names an error (a JSON log record of level ERROR or
    CRITICAL, with the last line of its exception, or a Python exception line such as
    `OSError: ...`), else the last non-empty line;
    None when the log is empty or missing."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if str(record.get("level", "")).upper() in ("ERROR", "CRITICAL"):
                exc = str(record.get("exc") or "").strip().splitlines()
                return str(record.get("msg") or line) + (f": {exc[-1]}" if exc else "")
        elif (
            ("Error" in line or "Exception" in line)
            and ": " in line
            and not line.startswith("File ")
        ):
            return line
    return lines[-1] if lines else None
