"""`shellrl submit FILE.jsonl`: post a task file to the rollout gateway's `POST /v1/tasks`.

One JSON object per line, the body of `POST /v1/tasks` (what `python -m tasksets export` writes;
blank lines skipped). Lines are sent in batches of `--batch-size` as JSON lists; the gateway
validates a whole batch before it stores any of it, and names the bad field as
`tasks[i].<field>`, which is reported here as `FILE:LINE: <field>: <message>`. Re-submitting a
file is idempotent (same content = `duplicate`).

The gateway's token comes from SHELLRL_API_TOKEN, SHELLRL_API_TOKEN_FILE or the running local
stack's `.shellrl/api_token` (`cli.stack_config.api_headers`).

Exit status: 0 all stored, 1 a line was rejected or the gateway failed, 2 the file is unreadable.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx

from cli.errors import token_hint
from cli.stack_config import STATE_DIR, api_headers, gateway_url

_LIST_FIELD = re.compile(r"^tasks\[(\d+)\]\.?(.*)$")


def add_arguments(parser) -> None:
    """FILE, then the flags of SubmitOptions (cli/command_options.py; also
    SHELLRL_CLI_SUBMIT_<OPTION>)."""
    from cli.command_options import SubmitOptions
    from cli.options import add_options

    parser.add_argument("file", type=Path, help="JSONL task file ('-' = stdin)")
    add_options(parser, SubmitOptions)
    parser.set_defaults(_options=SubmitOptions)


def read_lines(path: Path) -> list[tuple[int, dict]]:
    """[(line number, JSON object)]. Raises ValueError naming the line of bad JSON."""
    text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: invalid JSON: {exc}") from None
        out.append((n, obj))
    return out


def submit(
    path: Path,
    url: str,
    *,
    batch_size: int = 500,
    split: str | None = None,
    timeout_s: float = 60.0,
    echo=print,
    headers: dict | None = None,
    state_dir: Path = STATE_DIR,
) -> dict:
    """Post the file; returns {"created", "duplicates", "errors": [str], "task_ids": [str]}.
    `headers`: the gateway's `Authorization` (default: `api_headers(state_dir)`)."""
    if batch_size < 1:
        raise ValueError("batch_size must be >= 1")
    lines = read_lines(path)
    summary: dict = {"created": 0, "duplicates": 0, "errors": [], "task_ids": []}
    headers = api_headers(state_dir) if headers is None else headers
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s, headers=headers) as client:
        for start in range(0, len(lines), batch_size):
            batch = lines[start : start + batch_size]
            body = [
                {**obj, "split": obj.get("split") or split}
                if split and isinstance(obj, dict)
                else obj
                for _, obj in batch
            ]
            try:
                response = client.post("/v1/tasks", json=body)
            except httpx.HTTPError as exc:
                summary["errors"].append(f"{url}: {type(exc).__name__}: {exc}")
                return summary
            if response.status_code == 201:
                data = response.json()
                summary["created"] += data["created"]
                summary["duplicates"] += data["duplicates"]
                summary["task_ids"] += [t["task_id"] for t in data["tasks"]]
                for (n, _), result in zip(batch, data["tasks"]):
                    echo(f"{path}:{n}: {result['status']} {result['task_id']}")
                continue
            summary["errors"].append(_describe_error(path, batch, response, state_dir))
    return summary


def _describe_error(
    path: Path, batch: list[tuple[int, dict]], response: httpx.Response, state_dir: Path
) -> str:
    if response.status_code == 401:
        return f"{response.request.url} refused the token (401): {token_hint(state_dir)}"
    try:
        error = response.json().get("error") or {}
    except ValueError:
        return f"{path}: HTTP {response.status_code}: {response.text[:300]}"
    field, message = error.get("field") or "", error.get("message", "")
    match = _LIST_FIELD.match(field)
    if match and int(match.group(1)) < len(batch):
        line = batch[int(match.group(1))][0]
        inner = match.group(2) or "task"
        message = message.split(": ", 1)[1] if message.startswith(field + ":") else message
        return f"{path}:{line}: {inner}: {message} (HTTP {response.status_code})"
    return f"{path}: HTTP {response.status_code}: {message or response.text[:300]}"


def run(args) -> int:
    try:
        summary = submit(
            args.file,
            gateway_url(args.url, Path(args.state_dir)),
            batch_size=args.batch_size,
            split=args.split,
            timeout_s=args.timeout_s,
            echo=(lambda *_: None) if args.quiet else print,
            state_dir=Path(args.state_dir),
        )
    except (OSError, ValueError) as exc:
        print(f"shellrl submit: {exc}", file=sys.stderr)
        return 2
    for error in summary["errors"]:
        print(error, file=sys.stderr)
    print(
        f"{summary['created']} created, {summary['duplicates']} duplicates, {len(summary['errors'])} errors"
    )
    return 1 if summary["errors"] else 0
