"""Real sandbox services (`python -m services.sandbox`) for tests, one per configuration, started
lazily and shared by the whole test session (see the `sandbox_services` fixture in tests/conftest.py).

Every instance gets its own workspace root and planted secrets in its environment, so tests can
check that nothing of the service's environment reaches a command.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from tests.helpers.processes import ServiceProcess
from tests.helpers.redis_server import free_port

PLANTED_SECRETS = {
    "HF_TOKEN": "hf_planted_secret_3141",
    "AWS_SECRET_ACCESS_KEY": "aws_planted_secret_2718",
}


class SandboxServices:
    """`get(layer, **settings)` → a running ServiceProcess for that configuration (cached)."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = Path(base_dir)
        # session uids must traverse to their workspace: pytest's own temp root is mode 0700
        self.workspace_base = Path(tempfile.mkdtemp(prefix="shellrl-sandbox-test-"))
        os.chmod(self.workspace_base, 0o711)
        self.started: dict[tuple, ServiceProcess] = {}

    def get(self, layer: str = "bubblewrap", **settings: str) -> ServiceProcess:
        key = (layer, *sorted(settings.items()))
        if key not in self.started:
            name = "-".join([layer, *(f"{k}{v}" for k, v in sorted(settings.items()))])
            env = {
                **PLANTED_SECRETS,
                "SHELLRL_SANDBOX_ISOLATION": layer,
                "SHELLRL_WORKSPACE_ROOT": str(self.workspace_base / name),
                "SHELLRL_LOG_LEVEL": "INFO",
                **{f"SHELLRL_{k.upper()}": str(v) for k, v in settings.items()},
            }
            self.started[key] = ServiceProcess(
                "sandbox", free_port(), env, self.base_dir / name
            ).start()
        return self.started[key]

    def stop_all(self) -> None:
        for service in self.started.values():
            service.stop()
        self.started.clear()
        shutil.rmtree(self.workspace_base, ignore_errors=True)


def processes_of_uid(uid: int) -> list[int]:
    """Pids of live (non-zombie) processes whose real uid is `uid` (host view)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1 ").split()[0]) == uid and not fields.get(
            "State", ""
        ).strip().startswith("Z"):
            pids.append(int(entry))
    return pids


def wait_no_processes(uid: int, timeout_s: float = 3.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_of_uid(uid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left
