"""Which isolation layer works here: a start-up probe that really runs a command in each.

`detect` returns the best working layer of layers.py's ladder (or the forced one) and the probe
result per layer for /readyz.
"""

from __future__ import annotations

import logging
import os
import subprocess

from services.sandbox.isolation.launch import BWRAP, LAUNCHER_ENV, UNSHARE, setpriv_argv
from services.sandbox.isolation.layers import (
    BWRAP_NAMESPACES,
    BWRAP_PROCESS,
    BWRAP_USR,
    LAYERS,
    Isolation,
)

log = logging.getLogger(__name__)


_PROBE_BWRAP = [
    BWRAP,
    *BWRAP_NAMESPACES,
    "--as-pid-1",
    *BWRAP_PROCESS,
    *BWRAP_USR,
    "--proc",
    "/proc",
    "--dev",
    "/dev",
    "--tmpfs",
    "/workspace",
    "--remount-ro",
    "/",
    "--clearenv",
    "--",
]  # the launch's own base lists (layers.py), so the probe tries the flags sessions use
_PROBE_UNSHARE = [
    UNSHARE,
    "--pid",
    "--fork",
    "--kill-child",
    "--net",
    "--ipc",
    "--uts",
    "--mount",
    "--mount-proc",
    "--",
]
_PROBE_SCRIPT = (
    'echo ok > ${WS:-/workspace}/probe 2>/dev/null || [ -n "$WS" ]; [ ! -w /usr ] && echo ok'
)


def probe(layer: str, uid: int) -> str | None:
    """Really run a command in `layer` as `uid`; None when it works, else the reason."""
    if os.geteuid() != 0:
        return "the sandbox service needs root (uid drop to per-session uids, mounts, cgroups)"
    program = [*setpriv_argv(uid), "/usr/bin/bash", "-c", _PROBE_SCRIPT]
    argv = {
        "bubblewrap": [*setpriv_argv(uid), *_PROBE_BWRAP, "/usr/bin/bash", "-c", _PROBE_SCRIPT],
        "unshare": [*_PROBE_UNSHARE, *program],
        "fallback": program,
    }[layer]
    env = dict(LAUNCHER_ENV, WS="/nonexistent") if layer != "bubblewrap" else dict(LAUNCHER_ENV)
    try:
        out = subprocess.run(
            argv,
            env=env,
            cwd="/",
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{argv[0]}: {exc}"
    if out.returncode != 0 or b"ok" not in out.stdout:
        return f"{layer} probe exited {out.returncode}: {out.stderr.decode(errors='replace').strip()[:300]}"
    return None


def detect(choice: str, probe_uid: int) -> tuple[Isolation, dict[str, str | None]]:
    """The best working layer (or the forced one); the probe results per layer for /readyz.

    Raises RuntimeError when a forced layer does not work on this machine.
    """
    results: dict[str, str | None] = {}
    candidates = LAYERS if choice == "auto" else (choice,)
    for layer in candidates:
        results[layer] = probe(layer, probe_uid)
        if results[layer] is None:
            return Isolation(layer), results
        log.warning("isolation layer unavailable", extra={"layer": layer, "reason": results[layer]})
    raise RuntimeError(f"isolation {choice!r} is not available here: {results}")
