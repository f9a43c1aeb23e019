"""Structured JSON logs on stdlib `logging`.

`setup_logging("rollout")` installs one JSON formatter on the root logger. Ids travel as
structured fields: `log.info("scored", extra={"trajectory_id": t, "policy_version": v})`, or for
every line logged inside a block (a contextvar, so it follows one asyncio task and never leaks
into concurrent ones):

    with log_context(trajectory_id=t.trajectory_id, policy_version=v):
        ...  # each log line here carries both fields
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}
_CONTEXT: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "shellrl_log_context", default=None
)


@contextlib.contextmanager
def log_context(**fields) -> Iterator[None]:
    """Add `fields` (e.g. trajectory_id, group_id, policy_version) to every log line in the block."""
    token = _CONTEXT.set({**(_CONTEXT.get() or {}), **fields})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, service, logger, msg, and every `extra` field."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_CONTEXT.get() or {})
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(service: str, level: str = "INFO") -> None:
    """Route all logging to stderr as JSON lines tagged with `service`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.Formatter.converter = time.gmtime
