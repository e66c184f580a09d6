"""Run both benchmarks: ``python -m tests.benchmarks.run`` (from the repository root, in the venv).

Writes tests/benchmarks/results/search.json and tests/benchmarks/results/snapshot.json. A missed
target is reported as FAIL in the output and the JSON; the exit status is non-zero only when a
benchmark itself crashes.
"""

from __future__ import annotations

import sys
import time

from tests.benchmarks import bench_search, bench_snapshot


def main() -> int:
    started = time.perf_counter()
    status = bench_search.main([])
    print()
    status |= bench_snapshot.main([])
    print(f"\nboth benchmarks: {time.perf_counter() - started:.0f}s")
    return status


if __name__ == "__main__":
    sys.exit(main())
