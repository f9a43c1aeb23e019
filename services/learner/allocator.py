"""Run the learner on jemalloc: glibc malloc fragments under the learner's mix of long-lived
gradients and short-lived activations, so its RSS sits far above the tensors alive.

Measured here (SmolLM2-135M, one forward+backward over 8 x 512 tokens, per-sequence log-probs):
peak RSS above the loaded model 2993 MiB with glibc, 804 MiB with jemalloc; the whole-batch
baseline 4732 vs 3492 MiB (BENCHMARKS.md, "Learner (issue 7)"). glibc also keeps freed pages
between steps (feasibility.md: 1.7 -> 10 GB over a run); Trainer.step trims after every step.

jemalloc must be loaded before anything allocates, so `python -m services.learner` re-executes
itself once with LD_PRELOAD set (same pid, same arguments) when libjemalloc.so.2 is installed
(Debian: libjemalloc2) and SHELLRL_MALLOC is not "system". `release_memory` (after every
Trainer.step) collects garbage and hands freed heap pages back to the OS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
)


def jemalloc_path() -> str | None:
    """The jemalloc shared library on this machine, or None."""
    for candidate in CANDIDATES:
        if Path(candidate).exists():
            return candidate
    found = ctypes.util.find_library("jemalloc")
    return found if found and Path(found).exists() else None


def jemalloc_loaded() -> bool:
    return "jemalloc" in os.environ.get("LD_PRELOAD", "")


def reexec_with_jemalloc(module: str, argv: list[str]) -> None:
    """Replace this process by `python -m <module> <argv>` with jemalloc preloaded. Returns (does
    nothing) when it is already loaded, when SHELLRL_MALLOC=system, or when jemalloc is missing."""
    if jemalloc_loaded() or os.environ.get("SHELLRL_MALLOC", "jemalloc").lower() == "system":
        return
    library = jemalloc_path()
    if library is None:
        log.warning(
            "libjemalloc.so.2 not found (apt-get install libjemalloc2): using glibc malloc, "
            "whose RSS runs several times above live tensor memory"
        )
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = (
        f"{library} {env['LD_PRELOAD']}".strip() if env.get("LD_PRELOAD") else library
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


_LIBC = None


def release_memory() -> None:
    """Collect garbage and return freed heap pages to the OS (glibc malloc_trim), so RSS tracks
    live memory over a long run of steps with varying shapes (feasibility.md: 1.7 -> 10 GB)."""
    global _LIBC
    gc.collect()
    try:
        _LIBC = _LIBC or ctypes.CDLL("libc.so.6")
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):
        pass
