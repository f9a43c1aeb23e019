"""Benchmarks: `python -m benchmarks [name ...]` runs benchmarks/bench_<name>.py modules (see __main__)."""
