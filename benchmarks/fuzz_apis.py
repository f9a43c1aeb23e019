"""Schemathesis over every service's OpenAPI document, against a real local stack (`make fuzz`).

    python -m benchmarks.fuzz_apis [--max-examples 100] [--out benchmarks/out/fuzz]

Starts the stack of `shellrl up` (cli.launcher.Stack: Redis, engine on the tiny model, sandbox,
verifier, rollout, learner; free ports, its own state, workspace and checkpoint directories, a
fresh bearer token), then runs `schemathesis run <service>/openapi.json` on each service with the
token, every check (`--checks all`), positive and negative data, and a JSON report per run in
`--out`. The engine runs in three passes: everything but the two routes that block by design
(`/pause_generation`: generation waits until `/continue_generation`, as in SGLang;
`/init_weights_update_group`: the rendezvous waits for its peers up to the weight-sync deadline),
then pause/continue alone (no generation to stall; the engine is resumed after it), then the group
route with schema-violating bodies only (refused before any rendezvous).

Prints one row per run: test cases, then the failures by schemathesis code (ST101 = a 5xx). Exit
status 1 when any run found a server error or could not run. Records go to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cli.launcher import Stack  # noqa: E402
from cli.stack_config import DEFAULT_PORTS, StackConfig  # noqa: E402
from tests.helpers.redis_server import free_port  # noqa: E402

BLOCKING = ("/pause_generation", "/init_weights_update_group")
PASSES: list[tuple[str, str, list[str]]] = [
    ("rollout", "rollout", []),
    ("sandbox", "sandbox", []),
    ("verifier", "verifier", []),
    ("learner", "learner", []),
    ("engine", "engine", [a for p in BLOCKING for a in ("--exclude-path", p)]),
    (
        "engine: pause/continue",
        "engine",
        ["--include-path", "/pause_generation", "--include-path", "/continue_generation"],
    ),
    (
        "engine: init group, bad bodies",
        "engine",
        ["--include-path", "/init_weights_update_group", "--mode", "negative"],
    ),
]


def start_stack(work: Path) -> Stack:
    """The whole stack on the tiny model in `work` (the launcher's token, one torch thread each)."""
    workspaces = work / "workspaces"
    workspaces.mkdir(parents=True)
    for path in (work, workspaces):  # the sandbox's session uids traverse them
        path.chmod(0o755)
    config = StackConfig(
        state_dir=work / "state",
        model_path="tiny",
        ports={name: free_port() for name in DEFAULT_PORTS},
        env={
            "SHELLRL_NUM_THREADS": "1",
            "SHELLRL_LOG_LEVEL": "WARNING",
            "SHELLRL_WORKSPACE_ROOT": str(workspaces),
            "SHELLRL_CHECKPOINT_DIR": str(work / "checkpoints"),
            "SHELLRL_WEIGHT_SYNC_DIR": str(work / "weights"),
        },
        echo_logs=False,
        ready_timeout_s=600,
    )
    return Stack(config).start()


def fuzz(url: str, token: str, extra: list[str], report: Path, args) -> dict:
    """One `schemathesis run`; returns its JSON report (or {"error": ...})."""
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{url}/openapi.json",
        "--header",
        f"Authorization: Bearer {token}",
        "--checks",
        "all",
        "--max-examples",
        str(args.max_examples),
        "--workers",
        str(args.workers),
        "--request-timeout",
        "300",
        "--max-response-time",
        "300",
        "--generation-database",
        "none",
        "--no-color",
        "--report",
        "json",
        "--report-json-path",
        str(report),
        *extra,
    ]
    log = report.with_suffix(".txt")
    with open(log, "w") as out:
        # cwd: schemathesis keeps a cache of failures in ./.schemathesis; there, not in the checkout
        subprocess.run(
            command, cwd=report.parent, stdout=out, stderr=subprocess.STDOUT, check=False
        )
    try:
        return json.loads(report.read_text())
    except (OSError, ValueError) as exc:
        return {"error": f"no report ({exc}); see {log}"}


def summary(name: str, data: dict, seconds: float) -> tuple[str, bool]:
    """A table row and whether it found a server error (or could not run)."""
    if "error" in data:
        return f"{name:<32} ERROR {data['error']}", True
    failures = {f["code"]: f["count"] for f in data.get("failures", [])}
    found = ", ".join(f"{code} x{n}" for code, n in sorted(failures.items())) or "none"
    cases = data["test_cases"]["generated"]
    errors = len(data.get("errors", []))  # schemathesis could not generate or send a case
    row = f"{name:<32} {cases:>6} cases {seconds:7.1f} s   failures: {found}"
    return row + (f"   ({errors} schemathesis errors)" if errors else ""), (
        "ST101" in failures or not cases
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuzz_apis", description=__doc__)
    parser.add_argument("--max-examples", type=int, default=100, help="per operation and phase")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "fuzz")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="shellrl-fuzz-"))
    rows, failed = [], False
    stack = start_stack(work)
    try:
        token = stack.config.api_token
        for name, service, extra in PASSES:
            report = args.out / (re.sub(r"[^a-z]+", "-", name).strip("-") + ".json")
            start = time.monotonic()
            data = fuzz(stack.config.url(service), token, extra, report, args)
            row, bad = summary(name, data, time.monotonic() - start)
            print(row, flush=True)
            rows.append(row)
            failed |= bad
            if name.startswith("engine: pause"):
                httpx.post(
                    f"{stack.config.url('engine')}/continue_generation",
                    json={},
                    headers=stack.config.auth_headers(),
                    timeout=60,
                ).raise_for_status()
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nschemathesis, --max-examples {args.max_examples}, reports in {args.out}/")
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
