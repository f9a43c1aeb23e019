"""What runs beside the sandbox's HTTP API while it lives: `running(parts)` runs the session
expiry sweep, the warm-pool filler and the host-health sampler, and on exit stops them and
deletes every session (the session manager's close).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from services.sandbox.parts import Parts
from shellrl.service.aio import cancel_and_wait


@contextlib.asynccontextmanager
async def running(parts: Parts) -> AsyncIterator[None]:
    """Run the background loops for the body of the `async with`, then close every session."""
    expiry = asyncio.create_task(parts.manager.expire_loop(parts.ttl_sweep_interval_s))
    filler = asyncio.create_task(parts.warm_pool.run())
    sampler = asyncio.create_task(parts.health.run(parts.health_interval_s))
    try:
        yield
    finally:
        await cancel_and_wait(expiry, filler, sampler)
        await parts.manager.close()
