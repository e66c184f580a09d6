"""probe_samples benchmark: does the size a search finds hold for every batch of the epoch?

On variable-length token data (tests/helpers/varlen.py: 1200 sequences of 16 tokens, 0.25% of them 8x
longer, padded to the longest of each batch; the long ones past the first batches) with a CPU
budget measured by retune's ``CpuPeakTracker``, one run measures, for ``probe_samples: first`` and
``largest``:

* the size found (binsearch, margin 0, 3 steps per trial);
* the largest real-step peak of the epoch that follows, as a ratio of the budget (every real step is
  measured as a probe is: ``measure_peak`` around the step plus the batch's bytes);
* the search's seconds, and of them the scan's (reading and sizing every sample once), and a second
  search at the next epoch (a re-tune: the cached sizes are reused, no second scan);
* what a scan costs per sample on a larger copy of the data (100,000 samples), for the default size
  and for ``sample_size`` functions, with and without ``scan_limit``.

Run: ``python -m tests.benchmarks.bench_probe_samples`` (writes tests/benchmarks/results/probe_samples.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from retune import ScheduledBatchSizeFinder
from retune.probing.sample_sizes import default_sample_size, scan_sizes, size_spread
from retune.schedule.models import parse_byte_size
from tests.helpers import varlen
from tests.helpers.lightning_ns import NAMESPACE, pl, seed

RESULTS = Path(__file__).parent / "results"
REPEATS = 3
SCAN_SAMPLES = 100_000


def one_fit(probe_samples: str) -> dict[str, Any]:
    """A two-epoch fit searching at fit start and again at epoch 1; every real step of epoch 0 measured."""
    seed(0)
    sched = varlen.schedule(probe_samples)
    sched["triggers"].append({"kind": "epoch", "at": [1]})
    finder = ScheduledBatchSizeFinder(sched, verbose=False, write_report=False)
    peaks = varlen.StepPeaks()
    model = varlen.TokenClassifier(varlen.TokenDataset(varlen.lengths()))
    steps = 0  # real steps of epoch 0, set when it ends

    class FirstEpochOnly(pl.Callback):  # type: ignore[misc]
        """Measure epoch 0 only: epoch 1 exists for the re-tune."""

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            nonlocal steps
            if trainer.current_epoch == 0:
                steps = len(peaks.peaks)

    varlen.trainer([finder, peaks, FirstEpochOnly()], epochs=2).fit(model)
    cold, retune = finder.history
    epoch_peaks = peaks.peaks[:steps]
    budget = parse_byte_size(varlen.BUDGET)
    return {
        "size": cold.batch_size_after,
        "trials": len(cold.trials),
        "steps": len(epoch_peaks),
        "max_peak_over_budget": max(epoch_peaks) / budget,
        "steps_over_budget": sum(p > budget for p in epoch_peaks),
        "search_s": cold.duration_s,
        "retune_search_s": retune.duration_s,
        "scan_s": finder.probe_batches.scan_seconds,
        "scans": finder.probe_batches.cache.scans,
    }


def scan_costs() -> dict[str, float]:
    """Microseconds per sample for a scan of SCAN_SAMPLES samples (median of REPEATS)."""
    data = varlen.TokenDataset([varlen.BASE_LEN] * SCAN_SAMPLES)
    candidates = range(len(data))

    def per_sample(fn: Any, limit: int | None = None) -> float:
        times = []
        for _ in range(REPEATS):
            scan = scan_sizes(data, candidates, fn, limit)
            times.append(scan.seconds / scan.scanned)
        return statistics.median(times) * 1e6

    def getitem_only() -> float:
        times = []
        for _ in range(REPEATS):
            started = time.perf_counter()
            for i in candidates:
                data[i]
            times.append((time.perf_counter() - started) / len(data))
        return statistics.median(times) * 1e6

    started = time.perf_counter()
    size_spread(data, candidates, default_sample_size)
    spread_ms = (time.perf_counter() - started) * 1e3
    limited = scan_sizes(data, candidates, default_sample_size, 10_000)
    return {
        "getitem_us_per_sample": getitem_only(),
        "default_size_us_per_sample": per_sample(default_sample_size),
        "token_count_us_per_sample": per_sample(varlen.token_count),
        "scan_limit_10000_s": limited.seconds,
        "spread_look_ms": spread_ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(RESULTS / "probe_samples.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name in ("pytorch_lightning", "lightning", "lightning.pytorch", "lightning_fabric", "retune"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    rows: dict[str, dict[str, Any]] = {}
    for mode in ("first", "largest"):
        print(f"[bench] probe_samples: {mode}", flush=True)
        runs = [one_fit(mode) for _ in range(REPEATS)]
        row = dict(runs[0])
        for key in ("search_s", "retune_search_s", "scan_s"):
            row[key] = statistics.median(r[key] for r in runs)
        assert all(r["size"] == row["size"] for r in runs), "the search is deterministic"
        rows[mode] = row
    costs = scan_costs()
    extra = rows["largest"]["scan_s"]
    print()
    print(
        f"budget {varlen.BUDGET}; {varlen.N_SAMPLES} samples, "
        f"{len(varlen.LONG_AT)} of them {varlen.LONG_FACTOR}x longer"
    )
    print(
        "| probe_samples | size found | trials | worst real step ÷ budget | steps over budget "
        "| search s | of it scan s | re-tune s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, r in rows.items():
        print(
            f"| `{mode}` | {r['size']} | {r['trials']} | {r['max_peak_over_budget']:.2f} | "
            f"{r['steps_over_budget']} of {r['steps']} | {r['search_s']:.2f} | {r['scan_s']:.3f} | "
            f"{r['retune_search_s']:.2f} |"
        )
    print(
        f"scan of {SCAN_SAMPLES} samples: dataset[i] alone {costs['getitem_us_per_sample']:.1f} us/sample, "
        f"+ default size {costs['default_size_us_per_sample']:.1f} us/sample, "
        f"token_count {costs['token_count_us_per_sample']:.1f} us/sample; scan_limit 10000: "
        f"{costs['scan_limit_10000_s']:.3f} s; spread look (48 samples): {costs['spread_look_ms']:.2f} ms"
    )
    targets = {
        "largest: every real step within the budget": rows["largest"]["max_peak_over_budget"] <= 1.0,
        "first: the epoch overflows the budget (the reason for the option)": rows["first"]["max_peak_over_budget"]
        > 1.0,
        "largest: one scan per run (the re-tune reuses it)": rows["largest"]["scans"] == 1,
    }
    for name, ok in targets.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    out = {
        "lightning": f"{NAMESPACE} {pl.__version__}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "budget": varlen.BUDGET,
        "samples": varlen.N_SAMPLES,
        "long_samples": len(varlen.LONG_AT),
        "repeats": REPEATS,
        "rows": rows,
        "scan_extra_s": extra,
        "scan_costs": costs,
        "targets": targets,
        "seconds": time.perf_counter() - started,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out} ({out['seconds']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
