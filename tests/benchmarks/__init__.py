"""Benchmarks: retune against Lightning's own BatchSizeFinder (not part of the default test run).

Run them with ``python -m tests.benchmarks.run`` (see tests/benchmarks/README.md).
"""
