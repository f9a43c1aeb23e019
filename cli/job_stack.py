"""The main job's requests to its running stack (cli/main_job.py; also `shellrl run --attach`,
`shellrl eval` and `shellrl pass-rates`): submit tasks to the gateway (`submit`), check that the
verifier runs with the job's `require_command` (`check_verifier_config`), and wait until the
engines serve the learner's policy before evaluating it (`wait_for_served_policy`).
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from cli.polling import poll_until
from cli.stack_failure import StackError
from shellrl.contract import task_to_json


def submit(client: httpx.Client, tasks: list, eval_copy: bool = False) -> list[str]:
    """POST tasks; `eval_copy` submits training tasks as `eval-<id>` copies in split `eval`, so
    that evaluating them never adds them to the training pool."""
    ids = []
    for i in range(0, len(tasks), 200):
        batch = []
        for t in tasks[i : i + 200]:
            body = task_to_json(t)
            if eval_copy and body["split"] == "train":
                body["split"], body["task_id"] = "eval", f"eval-{body['task_id']}"
            batch.append(body)
        r = client.post("/v1/tasks", json=batch, timeout=60)
        r.raise_for_status()
        ids += [row["task_id"] for row in r.json()["tasks"]]
    return ids


def wait_for_served_policy(
    learner_url: str,
    headers: dict,
    check_alive: Callable[[], None] = lambda: None,
    timeout_s: float = 180.0,
) -> int:
    """Wait until the engines serve the learner's policy: the learner publishes a version once
    every engine in rotation confirmed its weights (`weight_sync.published_version` of its
    /v1/status), at start the version it resumed (0 when fresh). A before-evaluation started
    earlier could score other weights (a killed learner's newer ones still on the engine).
    Returns that version; raises StackError after timeout_s (polls every second)."""
    last: dict = {}

    def served() -> bool:
        check_alive()
        status = httpx.get(f"{learner_url}/v1/status", timeout=10, headers=headers).json()
        last["version"] = status.get("version")
        last["published"] = (status.get("weight_sync") or {}).get("published_version")
        return last["published"] == last["version"]

    if not poll_until(served, timeout_s=timeout_s, interval_s=1.0):
        raise StackError(
            f"the engines do not serve the learner's policy version {last['version']} after "
            f"{timeout_s:.0f} s (published: {last['published']}); see the learner's log (weight "
            "sync)"
        )
    return int(last["version"])


def check_verifier_config(
    verifier_url: str, require_command: bool, headers: dict | None = None
) -> None:
    """Raise RuntimeError unless the running verifier's `require_command` (GET /v1/config) is the
    job's: an environment that overrode it would silently train on guesses again (run6)."""
    config = httpx.get(f"{verifier_url}/v1/config", timeout=10, headers=headers).json()
    running = config.get("require_command")
    if running is not require_command:
        raise RuntimeError(
            f"the verifier runs with require_command={running!r}, the job asks for {require_command}"
        )
