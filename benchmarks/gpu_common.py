"""Shared pieces of the GPU benchmarks (issue 9): the engine as a real subprocess, timing statistics.

`EngineProcess` runs `python -m services.engine --model-path DIR --device cuda:N` (the project's
engine, bf16 on CUDA) on a free port and stops it by pid; its log goes to a file next to the model.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
from pathlib import Path

from shellrl.service.main import wait_until_ready
from shellrl.service.ports import free_port

REPO = Path(__file__).resolve().parents[1]


def summary_ms(samples_s: list[float]) -> dict:
    """{"n", "median_ms", "p90_ms", "min_ms", "max_ms"} of durations in seconds."""
    ms = sorted(x * 1e3 for x in samples_s)
    if not ms:
        return {"n": 0}
    p90 = ms[min(len(ms) - 1, round(0.9 * (len(ms) - 1)))]
    return {
        "n": len(ms),
        "median_ms": statistics.median(ms),
        "p90_ms": p90,
        "min_ms": ms[0],
        "max_ms": ms[-1],
    }


class EngineProcess:
    """The project's engine in its own process (see the module docstring)."""

    def __init__(
        self, model_dir: Path, device: str, log_path: Path, *, env: dict[str, str] | None = None
    ) -> None:
        self.model_dir, self.device, self.log_path = Path(model_dir), device, Path(log_path)
        self.port = free_port()
        self.env = env or {}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, ready_timeout_s: float = 600.0) -> EngineProcess:
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "SHELLRL_LOG_LEVEL": "WARNING",
            "SHELLRL_AUTH_DISABLED": "true",  # a benchmark's own engine on loopback
            **self.env,
        }
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes to it until stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.engine",
                "--model-path",
                str(self.model_dir),
                "--device",
                self.device,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            cwd=REPO,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_until_ready(self.url, ready_timeout_s, process=self.proc, what="engine")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}:\n{self.tail()}") from None
        return self

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # leftovers of the group we started
        except ProcessLookupError:
            pass
        self._log.close()
        self.proc = None
