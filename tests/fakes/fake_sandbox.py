"""FAKE sandbox service (replaces `services/sandbox`) with zero-latency answers, for the rollout
gateway's overhead benchmark only: it runs no command, so the benchmark measures the gateway's own
cost per turn rather than bubblewrap's. Speaks the sandbox HTTP API (DESIGN.md section 2), so the
gateway uses its real `SandboxClient`.

    python -m tests.fakes.fake_sandbox --port P
"""

from __future__ import annotations

import argparse
import itertools

import uvicorn
from fastapi import FastAPI, Response

_EXEC = {
    "stdout": "",
    "stderr": "",
    "exit_code": 0,
    "timed_out": False,
    "stdout_truncated_bytes": 0,
    "stderr_truncated_bytes": 0,
    "duration_ms": 0.0,
    "policy": {"verdict": "allow", "rule": None},
}


def build_app() -> FastAPI:
    app = FastAPI()
    ids = itertools.count()

    @app.post("/v1/sessions", status_code=201)
    async def create() -> dict:
        return {"session_id": f"fake-{next(ids)}", "isolation": "fake", "workspace": "/workspace"}

    @app.post("/v1/sessions/{session_id}/exec")
    async def execute(session_id: str) -> dict:
        return _EXEC

    @app.delete("/v1/sessions/{session_id}", status_code=204)
    async def delete(session_id: str) -> Response:
        return Response(status_code=204)

    @app.get("/readyz")
    async def ready() -> dict:
        return {"ready": True}

    return app


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
