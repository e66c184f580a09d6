"""Run every benchmark: ``python -m tests.benchmarks.run`` (from the repository root, in the venv).

Writes tests/benchmarks/results/search.json, tests/benchmarks/results/snapshot.json (one torch
thread), tests/benchmarks/results/snapshot-default-threads.json (torch's default) and
tests/benchmarks/results/probe_samples.json, tests/benchmarks/results/throughput.json,
tests/benchmarks/results/lr.json, tests/benchmarks/results/fsdp2.json,
tests/benchmarks/results/buckets.json and tests/benchmarks/results/prediction.json. A missed
target is reported as FAIL in the output and the JSON; the exit status is non-zero only when a
benchmark itself crashes.
"""

from __future__ import annotations

import sys
import time

from tests.benchmarks import (
    bench_buckets,
    bench_fsdp2,
    bench_lr,
    bench_oom_overhead,
    bench_prediction,
    bench_probe_samples,
    bench_search,
    bench_snapshot,
    bench_throughput,
)
from tests.benchmarks.bench_snapshot import RESULTS


def main() -> int:
    started = time.perf_counter()
    status = bench_search.main([])
    print()
    status |= bench_snapshot.main([])  # one torch thread: stable timings for the proportionality check
    print()
    # torch's default threads, as a user's run has them: the copies use every core, Lightning's
    # serialisation does not
    status |= bench_snapshot.main(["--threads", "0", "--out", str(RESULTS / "snapshot-default-threads.json")])
    print()
    status |= bench_probe_samples.main([])
    print()
    status |= bench_throughput.main([])
    print()
    status |= bench_lr.main([])  # learning-rate re-tuning: accuracy and cost, about 5 minutes
    status |= bench_oom_overhead.main([])  # the oom trigger's per-step cost without an OOM, about 2 minutes
    print()
    status |= bench_fsdp2.main([])  # 2 gloo processes per strategy, started as subprocesses
    print()
    status |= bench_buckets.main([])  # first vs largest vs buckets on variable-length data, about 13 minutes
    print()
    status |= bench_prediction.main([])  # search.predict: auto vs off (issue 29), about 5 minutes
    print(f"\nall benchmarks: {time.perf_counter() - started:.0f}s")
    return status


if __name__ == "__main__":
    sys.exit(main())
