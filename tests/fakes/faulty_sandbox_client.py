"""FaultySandboxClient: replaces shellrl.clients.sandbox.SandboxClient in tests that need one
session's sandbox answers to be broken while every other session talks to the real sandbox.

For session ids in `broken`, `session_info` returns a malformed body (no "workspace" key), the
kind of answer the verifier does not anticipate; every other call goes to the real service.
"""

from __future__ import annotations

from shellrl.clients.sandbox import SandboxClient


class FaultySandboxClient(SandboxClient):
    def __init__(self, base_url: str, broken: set[str]) -> None:
        super().__init__(base_url)
        self.broken = broken

    async def session_info(self, session_id: str) -> dict:
        if session_id in self.broken:
            return {"session_id": session_id, "unexpected": True}
        return await super().session_info(session_id)
