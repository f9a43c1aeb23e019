"""Post a task file (JSONL: one `POST /v1/tasks` body a line, as `python -m tasksets export` writes) to
the rollout gateway.

shellrl submit tasks.jsonl [--url http://127.0.0.1:8100] [--batch-size 500] [--split train]
"""

from __future__ import annotations

NAME = "submit"
HELP = "post a JSONL task file to the rollout gateway (POST /v1/tasks)"


def add_arguments(parser) -> None:
    from cli.submit import add_arguments as add

    add(parser)


def run(args) -> int:
    from cli.submit import run as submit

    return submit(args)
