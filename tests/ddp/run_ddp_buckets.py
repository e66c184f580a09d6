"""``search.batching: buckets`` under DDP on CPU (gloo, 2 processes); each rank writes what it saw as JSON.

Run by tests/buckets/test_ddp.py in a subprocess with a timeout. Two epochs, the backbone unfrozen at
the second, so the buckets are searched at fit start and re-tuned mid-run on both ranks. Each rank
records every real batch (its samples' indices and the bucket it came from) and measures every real
step as a probe is measured.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from retune import ScheduledBatchSizeFinder
from tests.ddp import ddp_trainer
from tests.helpers import bucket_data
from tests.helpers.dist_utils import leave_rank
from tests.helpers.lightning_ns import pl
from tests.helpers.varlen import StepPeaks


class Record(pl.Callback):  # type: ignore[misc,name-defined]
    def __init__(self, out: Path, finder: ScheduledBatchSizeFinder, peaks: StepPeaks) -> None:
        self.out, self.finder, self.peaks = out, finder, peaks
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        buckets = self.finder._buckets
        sampler = None if buckets is None else buckets.sampler
        self.steps.append(
            {
                "epoch": trainer.current_epoch,
                "indices": batch[2].tolist(),
                "bucket": None if sampler is None else sampler.bucket_at(batch_idx),
            }
        )

    def teardown(self, trainer: Any, model: Any, stage: str) -> None:
        result = {
            "rank": trainer.global_rank,
            "history": [e.to_dict() for e in self.finder.history],
            "bucket_sizes": self.finder.bucket_sizes,
            "steps": self.steps,
            "peaks": self.peaks.peaks,
            "global_step": trainer.global_step,
            "by_steps": self.finder._buckets is not None and self.finder._buckets.state.by_steps,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def run(
    out: Path,
    model: bucket_data.BucketModel,
    objective: str = "largest",
    search: dict[str, Any] | None = None,
    **trainer_kwargs: Any,
) -> None:
    """Fit ``model`` for two epochs (the backbone unfrozen at the second) on 2 ranks under DDP, or under
    the strategy in ``trainer_kwargs`` (tests/fsdp2/run_fsdp2_buckets.py), recording what each rank saw;
    ``search`` adds schedule fields (``predict``, ``buckets``)."""
    torch.set_num_threads(1)
    finder = ScheduledBatchSizeFinder(
        bucket_data.schedule(objective=objective, **(search or {})),
        sample_size=bucket_data.tokens,
        verbose=False,
        write_report=False,
    )
    peaks = StepPeaks()
    trainer = ddp_trainer(
        max_epochs=2,
        callbacks=[bucket_data.UnfreezeAt(1), finder, peaks, Record(out, finder, peaks)],
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    trainer.fit(model)


def main() -> None:
    pl.seed_everything(0)
    if sys.argv[2:] == ["by_steps"]:  # predict: auto on a tail the search re-cuts for fewer steps
        lengths = bucket_data.long_tail_lengths(401, **bucket_data.LONG_TAIL_BY_STEPS)  # type: ignore[arg-type]
        model = bucket_data.BucketModel(bucket_data.IndexedTokens(lengths), frozen=True)
        run(Path(sys.argv[1]), model, search={"predict": "auto", "buckets": 3})
        return
    model = bucket_data.BucketModel(bucket_data.IndexedTokens(bucket_data.long_tail_lengths(401)), frozen=True)
    run(Path(sys.argv[1]), model)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_rank()
