"""Benchmarks: `python -m bench` (= `nox -s bench`) runs them all; each writes bench/results/<name>.json."""
