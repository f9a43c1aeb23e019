"""Run the benchmarks: `python -m benchmarks` (every benchmarks/bench_*.py) or
`python -m benchmarks streams engine` (only bench_streams and bench_engine); `--quick` runs each
one's quick form (the tiny model, seconds to a minute each).

Each module's `main(argv)` runs in its own subprocess, so a failing or crashing benchmark does not
stop the others; arguments after `--` go to every selected benchmark (`python -m benchmarks rollout
-- --quick` = `python -m benchmarks rollout --quick`). Prints which ran, how long they took and
which failed; exits 1 if any failed. Run it with the project's interpreter (`make setup` makes
.venv: `.venv/bin/python -m benchmarks`), or through `make bench ARGS="..."`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def available(directory: Path = HERE) -> list[str]:
    return sorted(p.stem.removeprefix("bench_") for p in directory.glob("bench_*.py"))


def run(name: str, extra: list[str], directory: Path = HERE) -> tuple[int, float]:
    """`<package>.bench_<name>.main(extra)` in a fresh interpreter; returns (exit code, seconds)."""
    code = f"import sys; from {directory.name}.bench_{name} import main; main(sys.argv[1:])"
    start = time.monotonic()
    rc = subprocess.run(
        [sys.executable, "-c", code, *extra], cwd=directory.parent, check=False
    ).returncode
    return rc, time.monotonic() - start


def main(argv: list[str] | None = None, directory: Path = HERE) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        argv, extra = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names_available = available(directory)
    parser.add_argument(
        "names", nargs="*", help=f"benchmarks to run (default: all of {names_available})"
    )
    parser.add_argument(
        "--quick", action="store_true", help="each benchmark's quick form (passes --quick to it)"
    )
    args = parser.parse_args(argv)
    names = args.names or names_available
    if args.quick and "--quick" not in extra:
        extra = ["--quick", *extra]
    unknown = [
        n.removeprefix("bench_") for n in names if n.removeprefix("bench_") not in names_available
    ]
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {names_available}")
    outcomes = []
    for name in (n.removeprefix("bench_") for n in names):
        print(f"\n=== bench_{name} ===", flush=True)
        rc, seconds = run(name, extra, directory)
        outcomes.append((name, rc, seconds))
    print("\nbenchmarks run:")
    for name, rc, seconds in outcomes:
        print(
            f"  bench_{name:<12} {'ok' if rc == 0 else f'FAILED (exit {rc})':<16} {seconds:7.1f} s"
        )
    return 1 if any(rc for _, rc, _ in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
