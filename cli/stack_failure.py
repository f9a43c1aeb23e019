"""Why a local stack failed: `StackError`, `ServiceExited` (a service that died while the job
ran, with its failure class) and the last error line of a service's log.

cli/launcher.py raises StackError naming the service, its log file and `last_error_line` of it;
`Stack.raise_if_exited` raises ServiceExited, whose `failure_class` sorts the death into
"killed (SIGKILL)" (a negative exit status names the signal), "oom" (CUDA or host out of memory in
the log's last error line), "crash" (a Python exception there) or "exited" (anything else).
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

from cli.errors import CliError

# text of an out-of-memory death: torch.OutOfMemoryError / "CUDA out of memory", cuBLAS failing to
# allocate its workspace, Python's MemoryError or torch's CPU allocator on the host
# ("DefaultCPUAllocator: can't allocate memory: ... Error code 12 (Cannot allocate memory)")
_OOM = re.compile(
    r"out of memory|OutOfMemoryError|MemoryError|CUBLAS_STATUS_ALLOC_FAILED"
    r"|can't allocate memory|Cannot allocate memory",
    re.I,
)
# a Python exception line: `ValueError: ...`, `torch.distributed.DistBackendError: ...`, a traceback
_EXCEPTION = re.compile(r"\b[A-Za-z_][\w.]*(Error|Exception)\b|Traceback \(most recent call last\)")

# a tqdm progress bar (`Writing model shards: 100%|██████████| 1/1 [...]`): never a cause
_PROGRESS_BAR = re.compile(r"\d+%\|")


class StackError(CliError, RuntimeError):
    """The stack could not start (a port in use, a service that exited or never got ready); the
    message names the service, its log file and the log's last error line. Exit status 1."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_status=1)


def failure_class(status: int | None, cause: str | None) -> str:
    """The failure class of a service that exited. status: its exit status as `Popen.returncode`
    gives it (negative: killed by that signal; None: unknown, e.g. a process of another
    launcher); cause: its log's last error line (`last_error_line`). Returns "killed (SIGKILL)"
    for SIGKILL (the kernel's OOM killer or a person: nothing the process logged explains it),
    "oom" for an out-of-memory error (also when a signal followed it, e.g. the learner's SIGTERM
    to itself after its worker died), "killed (<SIGNAME>)" for another signal, "crash" for a
    Python exception, else "exited"."""
    killed = None
    if status is not None and status < 0:
        try:
            killed = f"killed ({signal.Signals(-status).name})"
        except ValueError:
            killed = f"killed (signal {-status})"
        if -status == signal.SIGKILL:
            return killed
    if cause and _OOM.search(cause):
        return "oom"
    if killed is not None:
        return killed
    if cause and _EXCEPTION.search(cause):
        return "crash"
    return "exited"


class ServiceExited(StackError):
    """A service (or Redis) of the stack exited while the job ran. service: its name; status: its
    exit status (negative: the signal that killed it); log_path: its log; cause: the log's last
    error line (None when the log is empty); failure_class: `failure_class(status, cause)`."""

    def __init__(self, service: str, status: int, log_path: Path, cause: str | None) -> None:
        self.service, self.status, self.log_path, self.cause = service, status, log_path, cause
        self.failure_class = failure_class(status, cause)
        last = f" (last error: {cause})" if cause else ""
        super().__init__(
            f"{service} exited with status {status} while the job ran: {self.failure_class}; "
            f"see {log_path}{last}"
        )

    def record(self) -> dict:
        """The failure as data (summary.json's `incomplete`, without the job's phase)."""
        return {
            "service": self.service,
            "status": self.status,
            "class": self.failure_class,
            "cause": self.cause,
            "log": str(self.log_path),
        }


def last_error_line(log_path: Path, tail_bytes: int = 64 * 1024) -> str | None:
    """The last line of a service log that names an error (a JSON log record of level ERROR or
    CRITICAL, with the last line of its exception, or a Python exception line such as
    `OSError: ...`), else the last non-empty line that is neither a JSON record of a lower level
    nor a progress bar (`Segmentation fault`, a C++ `terminate called ...`); None when there is
    none (a process killed by a signal while it logged INFO records) or the log is empty or
    missing."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    plain = []  # lines that are not JSON log records below ERROR, newest first
    for line in reversed(lines):
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                plain.append(line)
                continue
            if str(record.get("level", "")).upper() in ("ERROR", "CRITICAL"):
                exc = str(record.get("exc") or "").strip().splitlines()
                return str(record.get("msg") or line) + (f": {exc[-1]}" if exc else "")
            continue
        if not _PROGRESS_BAR.search(line):
            plain.append(line)
        if (
            ("Error" in line or "Exception" in line)
            and ": " in line
            and not line.startswith("File ")
        ):
            return line
    return plain[0] if plain else None
