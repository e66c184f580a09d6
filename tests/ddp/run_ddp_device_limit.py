"""No ``memory.budget`` under DDP on CPU (gloo, 2 processes), each rank's device giving it another limit.

Run by tests/distributed/test_ddp_device_limit.py in a subprocess with a timeout. Each rank reads its memory from
a caching allocator simulated on the CPU (:class:`RankAllocator`: the peaks a probe on the CPU measures, nothing
cached, and a device whose free memory gives rank 1 a little less than rank 0, as two GPUs' free memory
differs). Each rank writes what it applied and every limit its search read.

Scenarios:
  fixed    one batch size, ``mode: model``, ``predict: auto`` (the predicted search's traces, probes and start)
  buckets  ``batching: buckets``, ``predict: auto`` on a tail the search re-cuts for fewer steps (the bounds)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from retune import ScheduledBatchSizeFinder
from retune.allocator import AllocatorReading, use_memory_stats
from retune.buckets.batching import BucketSearch
from retune.memory import CpuPeakTracker, resident_bytes
from retune.probing.prober import Prober
from retune.search.batching import FixedSearch, SearchJob
from retune.search.largest import SearchResult
from tests.ddp import ddp_trainer
from tests.helpers import bucket_data
from tests.helpers.dist_utils import leave_rank, write_rank_result
from tests.helpers.lightning_ns import pl
from tests.prediction.test_predicted_search import WideMLP

MiB = 1 << 20
LIMITS = {
    "fixed": {0: 4 * MiB, 1: 4 * MiB - 256 * 1024},
    "buckets": {0: 4 * MiB + 512 * 1024, 1: 4 * MiB},
}
"""Each rank's limit (what its device's free memory gives it), by scenario: rank 1's is the smaller. Alone, rank 0's
limit fits 725 samples and rank 1's 665 (fixed), and cuts the tail's buckets at 943 and at 866 tokens (buckets)."""


class RankAllocator:
    """A caching allocator simulated on the CPU for one rank: peaks measured by the CPU tracker around each probe
    step (the module's resident state plus the step's tensors, as ``measure_peak`` measures a CPU step), nothing
    cached (reserved is allocated), and a device whose free memory leaves this rank ``limits[rank]`` bytes."""

    def __init__(self, module: Any, limits: dict[int, int]) -> None:
        self.module, self.limits = module, limits
        self._tracker: CpuPeakTracker | None = None
        self._base = 0
        self._peak = 0

    def reset_peaks(self) -> None:
        self._base = resident_bytes(self.module, list(self.module.trainer.optimizers))
        self._tracker = CpuPeakTracker()
        self._tracker.__enter__()

    def read(self) -> AllocatorReading:
        if self._tracker is not None:  # the end of a measured step
            tracker, self._tracker = self._tracker, None
            tracker.__exit__(None, None, None)
            self._peak = self._base + tracker.peak_bytes
        return AllocatorReading(0, 0, self._peak, self._peak)

    def device_free_and_total(self) -> tuple[int, int]:
        free = self.limits[int(self.module.global_rank)]
        return free, 2 * free

    def process_fraction(self) -> float:
        return 1.0


def record_limits() -> dict[str, list[int | None]]:
    """Every limit the searches read: the prober's at each trial, and the search's own (a fixed search's
    prediction's, the buckets' model's)."""
    seen: dict[str, list[int | None]] = {"prober": [], "search": []}
    measure, fixed_run, buckets_run = Prober.measure, FixedSearch.run, BucketSearch.run

    def prober_measure(self: Prober, size: int) -> tuple[bool, int | None]:
        seen["prober"].append(self.limit)
        return measure(self, size)

    def fixed(self: FixedSearch, job: SearchJob) -> SearchResult:
        seen["search"].append(self.predict_limit)
        return fixed_run(self, job)

    def buckets(self: BucketSearch, job: SearchJob) -> SearchResult:
        seen["search"].append(self.limit)
        return buckets_run(self, job)

    Prober.measure, FixedSearch.run, BucketSearch.run = prober_measure, fixed, buckets  # type: ignore[method-assign]
    return seen


class WriteResult(pl.Callback):  # type: ignore[misc,name-defined]
    def __init__(self, out: Path, finder: ScheduledBatchSizeFinder, seen: dict[str, list[int | None]]) -> None:
        self.out, self.finder, self.seen = out, finder, seen

    def teardown(self, trainer: Any, model: Any, stage: str) -> None:
        event = self.finder.history[0]
        write_rank_result(
            self.out,
            trainer.global_rank,
            self.finder,
            bucket_sizes=event.bucket_sizes,
            bucket_bounds=event.bucket_bounds,
            limits=self.seen,
            by_steps=self.finder._buckets is not None and self.finder._buckets.state.by_steps,
        )


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    pl.seed_everything(0)
    trigger = [{"kind": "fit_start"}]
    model: Any
    if scenario == "fixed":
        model = WideMLP(n=2048)
        search: dict[str, Any] = {"mode": "model", "margin": 0.0, "steps_per_trial": 2, "predict": "auto"}
        finder = ScheduledBatchSizeFinder({"triggers": trigger, "search": search}, verbose=False, write_report=False)
    else:
        lengths = bucket_data.long_tail_lengths(401, **bucket_data.LONG_TAIL_BY_STEPS)  # type: ignore[arg-type]
        model = bucket_data.BucketModel(bucket_data.IndexedTokens(lengths), frozen=True)
        search = {"batching": "buckets", "buckets": 3, "steps_per_trial": 2, "predict": "auto"}
        finder = ScheduledBatchSizeFinder(
            {"triggers": trigger, "search": search},
            sample_size=bucket_data.tokens,
            verbose=False,
            write_report=False,
        )
    seen = record_limits()
    trainer = ddp_trainer(callbacks=[finder, WriteResult(out, finder, seen)], limit_train_batches=2)
    allocator = RankAllocator(model, LIMITS[scenario])
    with use_memory_stats(lambda device: allocator):
        trainer.fit(model)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_rank()
