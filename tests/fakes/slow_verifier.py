"""SlowVerifier: the real services.verifier Verifier with a delay, for tests where one
verification must outlast a stream consumer's claim idle time (checks may run for up to an hour).

`verify` sleeps `delay_s` (asyncio, the loop stays free) and then runs the real verification.
"""

from __future__ import annotations

import asyncio

from services.verifier.verification import Verification, Verifier


class SlowVerifier:
    def __init__(self, verifier: Verifier, delay_s: float) -> None:
        self.verifier, self.delay_s = verifier, delay_s

    async def verify(
        self, task, answer, session_id, tool_events=(), trajectory_id: str = ""
    ) -> Verification:
        await asyncio.sleep(self.delay_s)
        return await self.verifier.verify(task, answer, session_id, tool_events, trajectory_id)
