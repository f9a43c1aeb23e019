"""The engine's composition root: `build_parts(settings)` loads the model into an `EngineRuntime`
(runtime.py: model, tokenizer, scheduler, weight store; seconds to minutes), and `Parts` is what
the routes (routes.py) receive. `parts_over(runtime)` wraps a given runtime (tests serve the
routes over a stub).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends

from services.engine.runtime import EngineRuntime
from services.engine.scheduler import Scheduler
from services.engine.settings import EngineSettings
from shellrl.service.parts import parts_dependency


@dataclass(frozen=True)
class Parts:
    """The engine's runtime and, for the routes that only talk to it, its scheduler."""

    settings: EngineSettings
    runtime: EngineRuntime
    scheduler: Scheduler


PartsDep = Annotated[Parts, Depends(parts_dependency(Parts))]
"""A route's parameter `parts: PartsDep` receives the app's Parts (shellrl/service/parts.py)."""


def build_parts(settings: EngineSettings) -> Parts:
    """Load the model and build the scheduler (not started: the app's lifespan starts it).
    Raises what loading the model raises."""
    return parts_over(EngineRuntime(settings))


def parts_over(runtime: EngineRuntime) -> Parts:
    return Parts(runtime.settings, runtime, runtime.scheduler)
