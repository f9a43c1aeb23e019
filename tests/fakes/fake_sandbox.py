"""FAKE sandboxes with zero-latency answers, for the rollout gateway's benchmark: they run no
command, so the benchmark measures the gateway's own cost per turn rather than bubblewrap's.

* `build_app()` replaces the sandbox SERVICE (`services/sandbox`): the routes the agent loop and
  the shared readiness wait use (`/readyz`, create, exec, delete), with the real service's paths
  and bodies (DESIGN.md section 2), so the gateway uses its real `SandboxClient` against it.
      python -m tests.fakes.fake_sandbox --port P
* `FakeSandbox` replaces the sandbox CLIENT (`shellrl.clients.sandbox.SandboxClient`) in process:
  every public method of the real client with the same parameters, answering at once (sessions
  are ids only; every command exits 0 with no output; files are empty).

tests/unit/test_fakes_match_services.py checks both against the real ones (routes, methods), so
that they cannot drift from what the rollout speaks.
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any, Self

import uvicorn
from fastapi import FastAPI

from shellrl.contract.exec import ExecResult

_EXEC = {
    "stdout": "",
    "stderr": "",
    "exit_code": 0,
    "timed_out": False,
    "stdout_truncated_bytes": 0,
    "stderr_truncated_bytes": 0,
    "duration_ms": 0.0,
    "queue_ms": 0.0,
    "policy": {"verdict": "allow", "rule": None},
}


def _session(session_id: str) -> dict[str, Any]:
    return {"session_id": session_id, "isolation": "fake", "workspace": "/workspace", "warm": False}


def build_app() -> FastAPI:
    """The fake sandbox service's app (module docstring)."""
    app = FastAPI()
    ids = itertools.count()

    @app.post("/v1/sessions", status_code=201)
    async def create_session() -> dict:
        return _session(f"fake-{next(ids)}")

    @app.post("/v1/sessions/{session_id}/exec")
    async def exec_command(session_id: str) -> dict:
        return _EXEC

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str) -> dict:
        return {"session_id": session_id, "deleted": True}

    @app.get("/readyz")
    async def readyz() -> dict:
        return {"ready": True, "service": "sandbox", "isolation": "fake"}

    return app


class FakeSandbox:
    """In-process stand-in for `SandboxClient` (module docstring): same methods, no HTTP."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.sessions: set[str] = set()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self.sessions.clear()

    async def create_session(
        self,
        setup: str = "",
        env: dict[str, str] | None = None,
        limits: dict | None = None,
        policy: str | None = None,
    ) -> dict[str, Any]:
        session_id = f"fake-{next(self._ids)}"
        self.sessions.add(session_id)
        return _session(session_id)

    async def create_session_when_free(
        self,
        *,
        poll_s: float,
        max_poll_s: float | None = None,
        attempts: int | None = None,
        **session: Any,
    ) -> tuple[dict[str, Any], float]:
        return await self.create_session(**session), 0.0  # never full: no wait

    async def exec(
        self,
        session_id: str,
        command: str,
        timeout_s: float | None = None,
        fresh_state: bool = False,
    ) -> ExecResult:
        return ExecResult.from_json(_EXEC)

    async def read_file(self, session_id: str, path: str, max_bytes: int = 10 << 20) -> bytes:
        return b""

    async def session_info(self, session_id: str) -> dict[str, Any]:
        return {**_session(session_id), "commands": 0, "safety_events": []}

    async def kill_processes(self, session_id: str) -> dict[str, Any]:
        return {"session_id": session_id, "killed": True, "duration_ms": 0.0}

    async def reset(self, session_id: str) -> dict[str, Any]:
        return {"session_id": session_id, "reset": True, "duration_ms": 0.0}

    async def delete(self, session_id: str) -> None:
        self.sessions.discard(session_id)

    async def diff(self, session_id: str, max_paths: int = 1000) -> dict[str, Any]:
        return {"changed": [], "count": 0, "truncated": False}

    async def ready(self) -> dict[str, Any]:
        return {"ready": True, "service": "sandbox", "isolation": "fake"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fakes.fake_sandbox", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    uvicorn.run(
        build_app(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False
    )


if __name__ == "__main__":
    main()
