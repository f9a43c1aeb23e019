"""`python -m benchmarks`: every bench module in its own process; a failing one does not stop the rest."""

from __future__ import annotations

import pytest

from benchmarks.__main__ import available, main


def _fake_benchmarks(tmp_path):
    pkg = tmp_path / "fakebench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bench_alpha.py").write_text("def main(argv=None):\n    print('alpha ran with', argv)\n")
    (pkg / "bench_boom.py").write_text("def main(argv=None):\n    raise RuntimeError('boom')\n")
    (pkg / "bench_zeta.py").write_text("import os\ndef main(argv=None):\n    os._exit(3)\n")
    return pkg


def test_every_benchmark_runs_even_after_one_fails(tmp_path, capfd):
    pkg = _fake_benchmarks(tmp_path)
    assert available(pkg) == ["alpha", "boom", "zeta"]
    assert main(["--", "--n", "5"], directory=pkg) == 1
    out = capfd.readouterr().out
    assert "alpha ran with ['--n', '5']" in out
    assert "bench_alpha" in out and "ok" in out
    assert "bench_boom" in out and "FAILED (exit 1)" in out
    assert "bench_zeta" in out and "FAILED (exit 3)" in out


def test_named_benchmarks_only_and_unknown_names_are_refused(tmp_path, capfd):
    pkg = _fake_benchmarks(tmp_path)
    assert main(["alpha"], directory=pkg) == 0
    out = capfd.readouterr().out
    assert "=== bench_alpha ===" in out and "bench_boom" not in out
    with pytest.raises(SystemExit):
        main(["nope"], directory=pkg)
    assert "unknown benchmark(s) ['nope']" in capfd.readouterr().err


def test_the_streams_benchmark_is_found():
    assert "streams" in available()


def test_quick_before_the_separator_reaches_each_benchmark_once(tmp_path, capfd):
    """A new user's `python -m benchmarks rollout --quick` was refused ("unrecognized arguments:
    --quick"); only `-- --quick` worked."""
    pkg = _fake_benchmarks(tmp_path)
    assert main(["alpha", "--quick"], directory=pkg) == 0
    assert "alpha ran with ['--quick']" in capfd.readouterr().out
    assert main(["alpha", "--quick", "--", "--quick", "--n", "2"], directory=pkg) == 0
    assert "alpha ran with ['--quick', '--n', '2']" in capfd.readouterr().out
