"""ScheduledLRFinder under DDP on CPU (gloo, 2 processes); each rank writes what it ended with as JSON.

Run by tests/lr/test_ddp.py in a subprocess with a timeout. Scenarios:
  agree   range tests at fit start and at epoch 1; rank 1's loss is scaled by 3, so the averaged curve
          differs from either rank's own: every rank records its own raw losses to check the average
  hand    the same run without the finder, setting by hand the rates `agree` found (read from its rank0.json)
  error   rank 1 raises inside the range test's 5th step
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.nn.functional as F

from retune import ScheduledLRFinder
from tests.ddp import ddp_trainer
from tests.helpers.dist_utils import leave_rank
from tests.helpers.lightning_ns import pl
from tests.helpers.oracle import FineTuneModel

SCHEDULE = {
    "triggers": [{"kind": "fit_start"}, {"kind": "epoch", "at": [1]}],
    "lr_find": {"steps": 20, "skip_begin": 2, "min_lr": 1e-4, "max_lr": 10.0},
}


class RankModel(FineTuneModel):
    def __init__(self, scenario: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.scenario = scenario
        self._raw_losses: list[float] = []

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = F.cross_entropy(self(x), y) * (3.0 if self.global_rank == 1 else 1.0)
        self._raw_losses.append(float(loss.detach()))
        if self.scenario == "error" and self.global_rank == 1 and len(self._raw_losses) == 5:
            raise ValueError("boom on rank 1")
        return loss


class SetByHand(pl.Callback):  # type: ignore[misc,name-defined]
    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.by_epoch = {e["epoch"]: e for e in events}

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        event = self.by_epoch.get(trainer.current_epoch)
        if event is not None:
            for group in event["groups"]:
                trainer.optimizers[0].param_groups[group]["lr"] = event["lr_after"]


class WriteResult(pl.Callback):  # type: ignore[misc,name-defined]
    def __init__(self, out: Path, finder: ScheduledLRFinder | None) -> None:
        self.out = out
        self.finder = finder

    def teardown(self, trainer: Any, model: Any, stage: str) -> None:
        weights = b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
        result = {
            "rank": trainer.global_rank,
            "history": [] if self.finder is None else [e.to_dict() for e in self.finder.history],
            "raw_losses": model._raw_losses,
            "weights_sha256": hashlib.sha256(weights).hexdigest(),
            "lrs": [g["lr"] for g in trainer.optimizers[0].param_groups],
            "global_step": trainer.global_step,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["agree", "hand", "error"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--events", type=Path, default=None, help="hand: the rank0.json of an `agree` run")
    args = parser.parse_args()

    torch.set_num_threads(1)
    pl.seed_everything(0)
    model = RankModel(args.scenario, batch_size=32, n=512, scheduler=None)
    extra: list[Any] = []
    finder = None
    if args.scenario == "hand":
        extra.append(SetByHand(json.loads(args.events.read_text())["history"]))
    else:
        finder = ScheduledLRFinder(SCHEDULE, verbose=False, write_report=False)
        extra.append(finder)
    trainer = ddp_trainer(
        max_epochs=2,
        callbacks=[*extra, WriteResult(args.out, finder)],
        limit_val_batches=0,
        deterministic=True,
    )
    trainer.fit(model)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_rank()
