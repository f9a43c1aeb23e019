"""Print one finished episode as the policy saw it: the task, the prompt, each turn's action and
the command output that came back, the verifier's result of each check, the reward and its
components, the failure class, and the policy version of every action.

    shellrl show <trajectory_id|task_id> [--url http://127.0.0.1:8100] [--json] [--tokens]

Reads the rollout gateway's `GET /v1/trajectories/{id}` with the stack's token (SHELLRL_API_TOKEN,
SHELLRL_API_TOKEN_FILE or `<--state-dir>/api_token`, as `shellrl submit`; a 401 says so). An id that names no
trajectory is taken as a task id: its newest finished trajectory is shown, and the others found
(`GET /v1/trajectories?task_id=`) are listed above it. Exit status: 0 shown, 1 no such trajectory
or task (trimmed from its stream, or never finished), 2 the gateway cannot be reached.
"""

from __future__ import annotations

from pathlib import Path

from cli.errors import CliError

NAME = "show"
HELP = (
    "print one finished trajectory (or a task's newest): prompt, actions, command outputs, "
    "checks, reward (GET /v1/trajectories)"
)


def add_arguments(parser) -> None:
    """ID, then the flags of ShowOptions (cli/command_options.py; also SHELLRL_CLI_SHOW_<OPTION>)."""
    from cli.command_options import ShowOptions
    from cli.options import add_options

    parser.add_argument(
        "trajectory_id",
        metavar="ID",
        help="id of a finished trajectory, or of a task (then its newest finished trajectory)",
    )
    add_options(parser, ShowOptions)
    parser.set_defaults(_options=ShowOptions)


def fetch(
    url: str, trajectory_id: str, *, timeout_s: float = 30.0, state_dir: Path | None = None
) -> dict:
    """The transcript JSON of `trajectory_id` from the gateway at `url` (the token of
    `api_headers(state_dir)`). Raises CliError: exit status 1 when the gateway answers 404, 2
    when it cannot be reached or answers another error (a 401 names where the token is read)."""
    import httpx

    from cli.stack_config import api_headers

    try:
        r = httpx.get(
            f"{url.rstrip('/')}/v1/trajectories/{trajectory_id}",
            headers=api_headers(*_given(state_dir)),
            timeout=timeout_s,
        )
    except httpx.HTTPError as exc:
        raise CliError(f"cannot reach the rollout gateway at {url}: {exc}") from None
    if r.status_code == 404:
        raise CliError(f"no finished trajectory {trajectory_id!r} at {url}", exit_status=1)
    _check_ok(url, r, state_dir)
    return r.json()


def _given(state_dir: Path | None) -> list[Path]:
    """[state_dir], or [] for the default (cli.stack_config.STATE_DIR)."""
    return [] if state_dir is None else [state_dir]


def _check_ok(url: str, r, state_dir: Path | None) -> None:
    from cli.errors import token_hint
    from cli.stack_config import STATE_DIR

    if r.status_code == 401:
        raise CliError(f"{url} refused the token (401): {token_hint(state_dir or STATE_DIR)}")
    if r.status_code != 200:
        raise CliError(f"{url} answered {r.status_code}: {r.text[:500]}")


def fetch_task(
    url: str,
    task_id: str,
    *,
    limit: int = 10,
    timeout_s: float = 30.0,
    state_dir: Path | None = None,
) -> list[dict]:
    """The newest finished trajectories of task `task_id` (summaries, newest first; [] when none
    is found) from the gateway at `url`. Raises CliError (exit status 2) when it cannot be
    reached or answers an error."""
    import httpx

    from cli.stack_config import api_headers

    try:
        r = httpx.get(
            f"{url.rstrip('/')}/v1/trajectories",
            params={"task_id": task_id, "limit": limit},
            headers=api_headers(*_given(state_dir)),
            timeout=timeout_s,
        )
    except httpx.HTTPError as exc:
        raise CliError(f"cannot reach the rollout gateway at {url}: {exc}") from None
    _check_ok(url, r, state_dir)
    return r.json()["trajectories"]


def resolve(
    url: str, some_id: str, *, timeout_s: float = 30.0, state_dir: Path | None = None
) -> tuple[dict, list[dict]]:
    """(transcript, the task's other trajectories): the trajectory `some_id`, else the newest of
    task `some_id` with the summaries of the others. Raises CliError (exit status 1) when it
    names neither."""
    try:
        return fetch(url, some_id, timeout_s=timeout_s, state_dir=state_dir), []
    except CliError as exc:
        if exc.exit_status != 1:
            raise
    found = fetch_task(url, some_id, timeout_s=timeout_s, state_dir=state_dir)
    if not found:
        raise CliError(f"no finished trajectory or task {some_id!r} at {url}", exit_status=1)
    newest = fetch(url, found[0]["trajectory_id"], timeout_s=timeout_s, state_dir=state_dir)
    return newest, found[1:]


def run(args) -> int:
    import json

    from rich.text import Text

    from cli.console import cli_console
    from cli.stack_config import gateway_url

    state_dir = Path(args.state_dir)
    view, others = resolve(
        gateway_url(args.url, state_dir),
        args.trajectory_id,
        timeout_s=args.timeout_s,
        state_dir=state_dir,
    )
    if args.as_json:
        print(json.dumps(view, indent=2))
        return 0
    console = cli_console()
    if view["trajectory_id"] != args.trajectory_id:
        console.print(Text(f"task {args.trajectory_id}: newest trajectory {view['trajectory_id']}"))
        for o in others:
            reward = "unscored" if o["reward"] is None else f"reward {o['reward']:g}"
            console.print(
                Text(
                    f"  also {o['trajectory_id']}: {reward}, failure {o['failure']}, "
                    f"checks {o['checks_passed']}/{o['checks']}"
                    + (f", eval {o['evaluation_id']}" if o["eval"] else "")
                )
            )
    console.print(*render(view, tokens=args.tokens))
    return 0


def render(view: dict, *, tokens: bool = False) -> list:
    """rich renderables of a transcript (the JSON of `GET /v1/trajectories/{id}`): a summary
    table, the task instruction, the prompt, one panel per segment, the verifier's per-check
    results, the reward components.
    Model and command text is printed literally (never read as rich markup)."""
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    reward = view.get("reward")
    rows = [
        ("trajectory", view["trajectory_id"]),
        ("task", view["task_id"]),
        ("group / attempt", f"{view.get('group_id') or '-'} / {view.get('attempt', 0)}"),
        ("split", ("eval " + view["evaluation_id"]) if view.get("eval") else view.get("split")),
        ("end", f"{view.get('end')} after {view.get('num_turns', 0)} turns"),
        ("answer", repr(view.get("answer") or "")),
        ("reward", "unscored" if reward is None else f"{reward:g}"),
        ("failure", view.get("failure", "none")),
        ("policy versions", ", ".join(map(str, view.get("policy_versions", []))) or "-"),
    ]
    if view.get("failure_detail"):
        rows.append(("failure detail", view["failure_detail"]))
    if view.get("safety_events"):
        rows.append(("safety events", ", ".join(view["safety_events"])))
    for key, value in rows:
        head.add_row(key, Text(str(value)))
    out: list = [head]
    task = view.get("task") or {}
    if task.get("instruction"):
        out.append(Panel(Text(task["instruction"]), title="task", title_align="left"))
    prompt = view["prompt"]
    out.append(_panel(Text(prompt["text"]), f"prompt · {len(prompt['token_ids'])} tokens", "dim"))
    if tokens:
        out.append(Text(str(prompt["token_ids"]), style="dim"))
    for turn in view["turns"]:
        for seg in turn["segments"]:
            out.append(_panel(Text(seg["text"]), _title(turn["turn"], seg), _style(seg)))
            if tokens:
                out.append(Text(str(seg["token_ids"]), style="dim"))
    if view.get("checks"):
        table = Table(title="checks (verifier)", title_justify="left")
        table.add_column("#", justify="right")
        table.add_column("check")
        table.add_column("result")
        table.add_column("detail")
        table.add_column("ms", justify="right")
        for i, check in enumerate(view["checks"]):
            table.add_row(
                str(i),
                Text(check["type"]),
                Text("pass", style="green") if check["passed"] else Text("FAIL", style="red"),
                Text(check.get("detail") or ""),
                f"{check.get('duration_ms', 0.0):.1f}",
            )
        out.append(table)
    if view.get("reward_components"):
        table = Table(title="reward components", title_justify="left")
        table.add_column("component")
        table.add_column("value", justify="right")
        for name, value in view["reward_components"].items():
            table.add_row(name, "-" if value is None else f"{value:g}")
        out.append(table)
    return out


def _panel(body, title: str, style: str):
    from rich.panel import Panel

    return Panel(body, title=title, title_align="left", border_style=style)


def _title(turn: int, seg: dict) -> str:
    n = len(seg["token_ids"])
    if seg["kind"] == "action":
        return (
            f"turn {turn} · action · policy v{seg['policy_version']} · {n} tokens"
            f" · {seg['finish_reason']}"
        )
    tool = seg.get("tool") or {}
    parts = [f"turn {turn} · observation · {n} tokens"]
    if tool.get("command"):
        parts.append(f"$ {tool['command'][:80]}")
    if tool:
        parts.append("timed out" if tool.get("timed_out") else f"exit {tool.get('exit_code')}")
    if tool.get("policy_verdict") and tool["policy_verdict"] != "allow":
        parts.append(f"{tool['policy_verdict']} ({tool.get('policy_rule')})")
    if tool.get("parse_error"):
        parts.append("parse error")
    return " · ".join(parts)


def _style(seg: dict) -> str:
    if seg["kind"] == "action":
        return "green"
    tool = seg.get("tool") or {}
    return "red" if tool.get("timed_out") or tool.get("exit_code", 0) != 0 else "blue"
