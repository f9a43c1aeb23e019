"""Async client of the verifier's synchronous `POST /v1/verify` (services/verifier/routes.py).

    verifier = VerifierClient("http://127.0.0.1:8102", timeout_s=120.0)
    verdict = await verifier.verify(task, answer, session_id, trajectory)
    await verifier.aclose()

The rollout gateway's evaluations score their episodes with it (eval episodes never enter the
training stream). No call is retried here: with `release_session` the verifier deletes the
sandbox session after scoring, so a repeated call would find the workspace gone.
"""

from __future__ import annotations

import httpx

from shellrl.clients.transport import auth_headers
from shellrl.contract import Task, Trajectory, task_to_json


class VerifierClient:
    """`POST {url}/v1/verify` (see services/verifier/routes.py for the body). `timeout_s` bounds one
    verification (every check of the task plus the reward), seconds. `api_token`: the stack's
    bearer token (None: the verifier runs without auth)."""

    def __init__(self, url: str, timeout_s: float, api_token: str | None = None) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(timeout=timeout_s, headers=auth_headers(api_token))

    async def verify(
        self, task: Task, answer: str | None, session_id: str | None, traj: Trajectory
    ) -> dict:
        """The verifier's JSON verdict for one episode: `reward` (null when unscored), `failure`,
        `checks`, `verifier_version` ... The session is released when `session_id` is given.
        Raises httpx.HTTPError (connection failure, timeout, non-2xx status)."""
        events = [
            {
                "command": e.command,
                "exit_code": None if e.exit_code < 0 else e.exit_code,
                "timed_out": e.timed_out,
                "policy_verdict": e.policy_verdict or "allow",
                "policy_rule": e.policy_rule or None,
            }
            for e in (s.tool_event for s in traj.segments if s.HasField("tool_event"))
            if e.command
        ]
        body = {
            "task": task_to_json(task),
            "answer": answer,
            "session_id": session_id or None,
            "tool_events": events,
            "release_session": bool(session_id),
        }
        response = await self._http.post(f"{self.url}/v1/verify", json=body)
        response.raise_for_status()
        return response.json()

    async def aclose(self) -> None:
        await self._http.aclose()
