"""Every benchmark's quick form runs to its end and prints its tables (issue 37: the rollout
benchmark broke unseen because nothing ran it).

Each `benchmarks/bench_<name>.py --quick` runs as its own subprocess, as `python -m benchmarks`
runs it, two at a time (they start together with the module's first test, in the order this
session's tests ask for them: each test then waits at most its own benchmark's run, whatever the
order pytest-randomly or -k gives); each test checks one benchmark's exit code and that its output
has the tables' headings and row labels, never their numbers (these machines are noisy). A new
benchmark needs an entry in PRINTS.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.__main__ import available
from tests.helpers.owned_processes import kill_group, popen_owned

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CUDA_DEVICES = {"gpu_decode": 1, "gpu_weight_sync": 2}  # needed; elsewhere it prints a skip line
PRINTS = {
    "control_plane": [
        "Control plane: measured points",
        "Cost per episode",
        "Extrapolated",
        "1024",
        "Redis instances",
        "2 x 1 + 1 shards",
    ],
    "consumer_bookkeeping": [
        "Consumer bookkeeping per entry",
        "hand-out",
        "one-by-one",
        "batched",
    ],
    "data_parallel": ["Learner tokens/s on CPU", "1 rank, no FSDP", "2 ranks, FSDP2", "gather s"],
    "dynamic_sampling": ["| setting |", "| baseline |", "| dynamic sampling |", "| groups trained"],
    "engine": ["Engine batching", "Whole-model weight update", "with prefix cache", "speed-up"],
    "engine_fleet": ["joining engine", "x one full push", "pinned", "unpinned"],
    "gpu_decode": ["Decode step", "eager vs CUDA graphs", "graphs / eager", "parity (greedy)"],
    "gpu_weight_sync": ["bucket, one copy + CUDA IPC", "WeightSync"],
    "http": ["round trip", "h11", "httptools", "vs h11"],
    "learner": ["Learner step", "Peak memory", "Weight push end to end", "disk (baseline)"],
    "learner_step": ["learner step, main job shapes", "before", "fused_unpadded", "grad cos"],
    "prefix_sharing": ["One group", "shared prefix, no checkpointing", "speed-up vs default"],
    "push_sizes_cpu": ["own receiving code", "stream 128", "old", "qwen2.5-7b"],
    "push_under_load": ["Weight push while the engine generates", "standalone", "in_place"],
    "rollout": ["Gateway overhead", "aiohttp", "turns/s", "Long tail", "async strict k=2"],
    "sandbox": ["sandbox exec of `true`", "baseline: bash -c true", "bubblewrap/session"],
    "sandbox_warm_pool": ["episode start", "groups, 100 files, pool off", "pool on", "warm starts"],
    "stream_appends": ["Redis server per append", "multi-norecord", "lua-3rt", "ratio"],
    "streams": ["Streams:", "protobuf, raw LE bytes", "JSON (orjson, lists)", "vs JSON"],
    "verifier": ["Verifier: latency", "Verifier stream", "file_exists", "p50 ms"],
    "weight_envelope": ["Whole-model push", "SGLang envelope", "gloo broadcast", "vs disk"],
}
TIMEOUT_S = 480  # a quick form takes seconds to a minute and a half on 2 busy cores
INTERRUPT_S = 30  # after TIMEOUT_S: SIGINT, then this long for its finally blocks, then SIGKILL
WORKERS = (
    2  # at a time: CI has 2 cores, and most quick forms wait on their services part of the time
)
# pytest-timeout's limit per test: a test waits for its own benchmark only (see QuickRuns)
TEST_TIMEOUT_S = TIMEOUT_S + INTERRUPT_S + 90


class QuickRuns:
    """The quick forms `names`, started WORKERS at a time in that order (the order the tests ask
    for them), each in its own process group (its services in theirs); `result(name)` waits for
    one. In that order, a benchmark has started by the time the one before it has ended, so a
    test that asks right after the previous test waits at most its own benchmark's run (under
    TIMEOUT_S + INTERRUPT_S), not the queue in front of it. `stop()` interrupts what still runs
    (SIGINT: a benchmark's finally blocks stop its services), then kills it by pid."""

    def __init__(self, names: list[str]) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        # the environment, copied here on pytest's own thread: pytest sets and deletes
        # PYTEST_CURRENT_TEST on it around every test phase, and a pool thread copying os.environ
        # meanwhile died with KeyError('PYTEST_CURRENT_TEST') (a fresh-clone CI, 2026-12-06)
        self.env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        self.env |= {"COLUMNS": "240", "SHELLRL_AUTH_DISABLED": "true"}
        self.pool = ThreadPoolExecutor(WORKERS)
        self.futures = {name: self.pool.submit(self._run, name) for name in names}

    def _run(self, name: str) -> tuple[int, str, str, float]:
        start = time.monotonic()
        proc = popen_owned(  # its own session, dies with this pytest (owned_processes)
            [sys.executable, "-m", f"benchmarks.bench_{name}", "--quick"],
            cwd=REPO,
            env=dict(self.env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs[name] = proc
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._interrupt(proc)
            out, err = proc.communicate()
            err += f"\n[timed out after {TIMEOUT_S} s]"
        return proc.returncode, out, err, time.monotonic() - start

    def result(self, name: str) -> tuple[int, str, str, float]:
        return self.futures[name].result()

    @staticmethod
    def _interrupt(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
            try:
                proc.wait(INTERRUPT_S)
            except subprocess.TimeoutExpired:
                kill_group(proc)

    def stop(self) -> None:
        for future in self.futures.values():
            future.cancel()
        for proc in list(self.procs.values()):
            self._interrupt(proc)
        self.pool.shutdown(wait=True)


def asked_for(items: list[pytest.Item]) -> list[str]:
    """The benchmarks this session's quick-form tests ask for, in the order they will run
    (session.items: after -k deselection and pytest-randomly's shuffle)."""
    here = Path(__file__).resolve()
    return [
        item.callspec.params["name"]
        for item in items
        if getattr(item, "originalname", None)
        == "test_quick_form_runs_to_its_end_and_prints_its_tables"
        and Path(item.path).resolve() == here
    ]


@pytest.fixture(scope="module")
def quick_runs(request):
    names = asked_for(request.session.items)
    runs = QuickRuns([n for n in names if _cuda_devices() >= CUDA_DEVICES.get(n, 0)])
    yield runs
    runs.stop()


def test_every_benchmark_has_a_quick_form_checked_here():
    assert sorted(PRINTS) == available()


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


@pytest.mark.timeout(TEST_TIMEOUT_S)
@pytest.mark.parametrize("name", sorted(PRINTS))
def test_quick_form_runs_to_its_end_and_prints_its_tables(name, quick_runs):
    if _cuda_devices() < CUDA_DEVICES.get(name, 0):
        pytest.skip(f"bench_{name} needs {CUDA_DEVICES[name]} CUDA device(s)")
    returncode, stdout, stderr, seconds = quick_runs.result(name)
    printed = re.sub(r"\s+", " ", stdout)
    assert returncode == 0, (
        f"exit {returncode} after {seconds:.0f} s\n{stdout[-3000:]}\n{stderr[-3000:]}"
    )
    missing = [text for text in PRINTS[name] if text not in printed]
    assert not missing, f"{missing} not printed:\n{stdout[-4000:]}"
