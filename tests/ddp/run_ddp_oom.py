"""One DDP run with the ``oom`` trigger on CPU (gloo, 2 processes); each rank writes its result as JSON.

Run by tests/distributed/test_ddp_oom.py in a subprocess with a timeout, so a hang fails the test instead of
hanging CI. Only rank 1 runs out of memory (tests/helpers/oom_oracle.py raises the real
``torch.OutOfMemoryError`` above a padded-token capacity); rank 0 has memory for every batch.

Usage: run_ddp_oom.py WHERE OUT   with WHERE one of forward, backward, none (no capacity on any
rank: the reference run), single (rank 1 cannot fit one sample: every rank must stop with an error),
inexact (rank 1's loss is a sum, rank 0's a mean: the fit-start exactness check refuses it on both ranks).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
import weakref
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from retune import ScheduledBatchSizeFinder
from tests.ddp import ddp_trainer
from tests.helpers.dist_utils import leave_rank
from tests.helpers.lightning_ns import pl
from tests.helpers.oom_oracle import TokenModel
from tests.helpers.token_tasks import TokenTask


class RankTokenModel(TokenModel):
    def __init__(self, rank1_capacity: int | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rank1_capacity = rank1_capacity

    def setup(self, stage: str) -> None:
        if self.global_rank == 1:
            self.capacity = self.rank1_capacity


class InexactOnRankOne(RankTokenModel):
    """Rank 1's loss is a sum over its samples, rank 0's a mean: only rank 1's exactness check fails."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * len(batch["labels"]) if self.global_rank == 1 else loss


class WatchWrapper(pl.Callback):  # type: ignore[misc,name-defined]
    """Keeps a weak reference to the DDP wrapper: retune holds it during training (its gradient sync)
    and must let it go before Lightning's teardown, while the process group is alive (tests/helpers/dist_utils.py)."""

    def __init__(self) -> None:
        self.wrapper: weakref.ref[Any] | None = None

    def on_train_start(self, trainer: Any, model: Any) -> None:
        self.wrapper = weakref.ref(trainer.strategy.model)


class RankTokenTask(TokenTask):
    """A token tagger with a token-mean loss whose step-level loss is synced across ranks (``sync_dist``)."""

    def __init__(self, rank1_capacity: int | None) -> None:
        super().__init__("torch", sync_dist=True)
        self.rank1_capacity = rank1_capacity

    def setup(self, stage: str) -> None:
        if self.global_rank == 1:
            self.capacity = self.rank1_capacity


def token_main(where: str, out: Path) -> None:
    """``token``: rank 1 runs out of memory above 50 tokens; ``token_none``: the reference."""
    torch.set_num_threads(1)
    pl.seed_everything(0)
    model = RankTokenTask(50 if where == "token" else None)
    trigger = {"kind": "oom", "loss_reduction": "token_mean"}
    finder = ScheduledBatchSizeFinder({"triggers": [trigger]}, verbose=False, write_report=False)
    trainer = ddp_trainer(
        callbacks=[finder],
        limit_val_batches=0,
    )
    result: dict[str, Any] = {}
    try:
        trainer.fit(model)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-2000:]
    result.update(
        rank=trainer.global_rank,
        global_step=trainer.global_step,
        weights=[p.detach().reshape(-1).tolist() for p in model.parameters()],
        trained=sorted(model.trained.items()),
        recoveries=[e.to_dict() for e in finder.history if e.is_recovery],
        step_losses=model.step_losses,
        lrs=model.lrs,
        output_rows=model.output_rows,
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    where, out = sys.argv[1], Path(sys.argv[2])
    if where.startswith("token"):
        token_main(where, out)
        return
    accumulate = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    torch.set_num_threads(1)
    pl.seed_everything(0)
    capacity = {"forward": 300, "backward": 300, "none": None, "single": 2, "inexact": None}[where]
    model_cls = InexactOnRankOne if where == "inexact" else RankTokenModel
    model = model_cls(capacity, where="backward" if where == "backward" else "forward", n=128, batch_size=16)
    finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "oom"}]}, verbose=False, write_report=False)
    trainer = ddp_trainer(
        callbacks=[finder, watch := WatchWrapper()],
        limit_val_batches=0,
        accumulate_grad_batches=accumulate,
    )
    result: dict[str, Any] = {}
    try:
        trainer.fit(model)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-2000:]
    import torch.distributed as dist

    gc.collect()
    result.update(
        wrapper_freed=watch.wrapper is not None and watch.wrapper() is None,
        group_alive=dist.is_initialized(),
        rank=trainer.global_rank,
        global_step=trainer.global_step,
        weights=[p.detach().reshape(-1).tolist() for p in model.parameters()],
        trained=sorted(model.trained.items()),
        recoveries=[e.to_dict() for e in finder.history if e.is_recovery],
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
    leave_rank()
