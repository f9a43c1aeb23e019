"""`python -m tasksets` — list, export and validate task sets.

  python -m tasksets list
  python -m tasksets export generated --split train > train.jsonl
  python -m tasksets validate [--sets seeds generated agentbench_os] [--splits ...] [--sample N]
                                   [--sandbox-url URL | --start-sandbox] [--no-cache]

`validate` runs every task's reference solution in a real sandbox (must pass) and a wrong answer
(must fail), prints pass rates per set and split, lists every failure, and exits 1 if any task
failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
from collections import Counter, defaultdict

from shellrl.contract import split_name, task_to_json
from shellrl.service.auth import new_token
from shellrl.service.main import wait_until_ready
from tasksets import SPLITS, TASKSETS, load_taskset


def _cmd_list(_: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="shellrl task sets")
    for col in ("set", "split", "tasks", "templates", "difficulty"):
        table.add_column(col)
    for name in ("seeds", "generated", "agentbench_os", "contrast"):
        by_split = defaultdict(list)
        for task in load_taskset(name):
            by_split[split_name(task.split)].append(task)
        for split, tasks in sorted(by_split.items()):
            difficulty = Counter(
                t.split(":", 1)[1]
                for task in tasks
                for t in task.tags
                if t.startswith("difficulty:")
            )
            table.add_row(
                name,
                split,
                str(len(tasks)),
                str(len({t.template for t in tasks if t.template})),
                " ".join(f"{k}={v}" for k, v in sorted(difficulty.items())),
            )
    Console().print(table)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    for task in load_taskset(args.set, args.split, seed=args.seed):
        sys.stdout.write(json.dumps(task_to_json(task)) + "\n")
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tasksets.validate import ValidationCache, generated_wrong_answers, validate_tasks

    tasks = [
        t
        for name in args.sets
        for split in (args.splits or [None])
        for t in load_taskset(name, split, seed=args.seed)
    ]
    if args.sample and args.sample < len(tasks):
        tasks = random.Random(args.seed).sample(tasks, args.sample)
    sandbox = _start_sandbox() if args.start_sandbox else None
    url = sandbox.url if sandbox else args.sandbox_url
    token = sandbox.api_token if sandbox else os.environ.get("SHELLRL_API_TOKEN")
    try:
        results = asyncio.run(
            validate_tasks(
                tasks,
                url,
                wrong_answers=generated_wrong_answers(tasks, args.seed),
                concurrency=args.concurrency,
                cache=None if args.no_cache else ValidationCache(),
                api_token=token,
            )
        )
    finally:
        if sandbox:
            sandbox.stop()
    console = Console(width=160)
    table = Table(title=f"reference solutions and wrong answers in a real sandbox ({url})")
    for col in (
        "source",
        "split",
        "tasks",
        "reference passes",
        "wrong answer fails",
        "cached",
        "p50 ms/task",
    ):
        table.add_column(col)
    groups = defaultdict(list)
    for r in results:
        groups[(r.source, r.split)].append(r)
    for (source, split), rs in sorted(groups.items()):
        ran = sorted(r.duration_ms for r in rs if not r.cached)
        table.add_row(
            source,
            split,
            str(len(rs)),
            _rate(sum(r.reference_passed for r in rs), len(rs)),
            _rate(sum(r.wrong_failed for r in rs), len(rs)),
            str(sum(r.cached for r in rs)),
            f"{ran[len(ran) // 2]:.0f}" if ran else "-",
        )
    table.add_row(
        "all",
        "",
        str(len(results)),
        _rate(sum(r.reference_passed for r in results), len(results)),
        _rate(sum(r.wrong_failed for r in results), len(results)),
        str(sum(r.cached for r in results)),
        "",
    )
    console.print(table)
    failures = [r for r in results if not r.ok]
    for r in failures:
        console.print(f"[red]FAIL[/red] {r.task_id}: {r.detail}")
    return 1 if failures else 0


def _rate(k: int, n: int) -> str:
    return f"{k}/{n} ({100 * k / n:.1f}%)" if n else "-"


class _SandboxProcess:
    """`python -m services.sandbox` on a free loopback port, for one validation run, with a fresh
    bearer token (`api_token`); stopped by pid."""

    def __init__(self) -> None:
        import socket
        import subprocess

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.api_token = new_token()
        inherited = ("SHELLRL_API_TOKEN", "SHELLRL_API_TOKEN_FILE", "SHELLRL_AUTH_DISABLED")
        env = {
            **{k: v for k, v in os.environ.items() if k not in inherited},
            "SHELLRL_API_TOKEN": self.api_token,
            "SHELLRL_PORT": str(port),
            "SHELLRL_HOST": "127.0.0.1",
            "SHELLRL_LOG_LEVEL": "WARNING",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.sandbox"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            wait_until_ready(self.url, 60, process=self.proc, what="sandbox")
        except RuntimeError as exc:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"sandbox exited: {self.proc.stderr.read().decode(errors='replace')[-2000:]}"
                ) from None
            self.stop()
            raise RuntimeError(str(exc)) from None

    def stop(self) -> None:
        import signal
        import subprocess

        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _start_sandbox() -> _SandboxProcess:
    return _SandboxProcess()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tasksets",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="task sets, splits and counts")
    export = sub.add_parser("export", help="write a task set as JSONL to stdout")
    export.add_argument("set", help=f"one of {TASKSETS} or a .jsonl path")
    export.add_argument("--split", choices=SPLITS)
    export.add_argument("--seed", type=int, default=0)
    validate = sub.add_parser(
        "validate", help="run reference solutions and wrong answers in a real sandbox"
    )
    validate.add_argument("--sets", nargs="+", default=["seeds", "generated", "agentbench_os"])
    validate.add_argument("--splits", nargs="+", choices=SPLITS)
    validate.add_argument(
        "--sample", type=int, default=0, help="validate a random sample of this many tasks"
    )
    validate.add_argument("--seed", type=int, default=0)
    validate.add_argument("--concurrency", type=int, default=4)
    validate.add_argument(
        "--sandbox-url", default=os.environ.get("SHELLRL_SANDBOX_URL", "http://127.0.0.1:8101")
    )
    validate.add_argument(
        "--start-sandbox", action="store_true", help="start a sandbox service for the run"
    )
    validate.add_argument(
        "--no-cache", action="store_true", help="ignore and do not update the validation cache"
    )
    args = parser.parse_args(argv)
    return {"list": _cmd_list, "export": _cmd_export, "validate": _cmd_validate}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
