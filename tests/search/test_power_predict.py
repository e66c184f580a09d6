"""``mode: power`` with ``search.predict: auto`` applies power mode's sizes: ``init_val`` doubled (or halved).

The docs say the size used is "the largest power-mode size (``init_val`` doubled) at or below the verified one".
The grid was built from the search's first size instead, which a warm start takes from the last search's largest
fit: a predicted fit at 36 was applied as 32, the re-tune after an unfreeze started from 36 and put its verified 23
on 36's grid (18), and the next search on 18's (23 -> 23, not 16). ``predict: off`` gives 32 -> 16 -> 16.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import retune.search.batching
from retune import ScheduledBatchSizeFinder, load_schedule
from retune.events import Trial
from retune.search.batching import FixedSearch, Limits, SearchJob
from retune.search.largest import SearchPlan, SearchResult, on_power_grid
from retune.search.stage import StageState
from tests.helpers.lightning_ns import pl, seed
from tests.helpers.varlen import trainer as quiet_trainer


def test_the_grid_is_init_vals() -> None:
    assert [on_power_grid(2, s, 8192) for s in (23, 36, 1, 8192)] == [16, 32, 1, 8192]
    assert [on_power_grid(3, s, 8192) for s in (23, 2, 100)] == [12, 1, 96]  # 3, 6, 12, ... and 3 halved


@pytest.mark.parametrize("start", [2, 36, 18])
def test_a_predicted_power_search_lands_on_init_vals_grid_wherever_it_starts(
    start: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm re-tune starts at the last largest fit (36, off the grid after a predicted search); the verified 23
    is applied as 16 (2 doubled), not 18 (36 halved)."""

    def verified(*args: Any, **kwargs: Any) -> SearchResult:
        return SearchResult(23, 23, 24, [Trial(23, True)])

    monkeypatch.setattr(retune.search.batching, "predicted_search", verified)
    schedule = load_schedule(
        {"search": {"mode": "power", "init_val": 2, "predict": "auto"}, "triggers": [{"kind": "fit_start"}]}
    )
    plan = SearchPlan("power", start=start, max_trials=25, margin=0.0, upper=8192)
    prober = SimpleNamespace(pl_module=None)
    job = SearchJob(None, "train", schedule, plan, prober, "down", start == 2, StageState())  # type: ignore[arg-type]
    limits = Limits("power", None, "", 1 << 20, torch.device("cpu"), 1 << 20)
    assert FixedSearch(limits).run(job).size == 16


class Backbone(pl.LightningModule):  # type: ignore[misc,name-defined]
    """Embedding + MLP backbone and a head: unfreezing the backbone (epoch 1) needs more memory per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 4
        self.backbone = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        self.head = nn.Linear(16, 3)
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(300, 24, 16, generator=g), torch.randint(0, 3, (300,), generator=g))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.backbone(x).mean(1)), y)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_every_size_a_predicted_power_search_applies_is_init_val_doubled() -> None:
    """The whole path: fit start, the re-tune after an unfreeze (warm, down) and an epoch milestone."""
    from tests.helpers.lightning_ns import NAMESPACE

    finetuning = __import__(NAMESPACE + ".callbacks", fromlist=["BackboneFinetuning"]).BackboneFinetuning
    seed(0)
    finder = ScheduledBatchSizeFinder(
        {
            "search": {"mode": "power", "init_val": 2, "predict": "auto"},
            "memory": {"budget": "1MiB"},
            "triggers": [{"kind": "fit_start"}, {"kind": "trainable_params_changed"}, {"kind": "epoch", "at": [2]}],
        },
        verbose=False,
        write_report=False,
    )
    trainer = quiet_trainer(
        [finetuning(unfreeze_backbone_at_epoch=1), finder], 3, limit_train_batches=2, limit_val_batches=0
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Backbone())
    events = finder.history
    assert [e.prediction for e in events] == ["predicted"] * 3, [e.note for e in events]
    grid = {2**k for k in range(1, 14)}
    assert all(e.batch_size_after in grid for e in events), [(e.batch_size_after, e.trials) for e in events]
    # each is the largest grid size at or below the largest size a probe verified
    for e in events:
        verified = max(t.batch_size for t in e.trials if t.fits)
        assert e.batch_size_after == max(g for g in grid if g <= verified), (e.batch_size_after, e.trials)
    assert events[1].batch_size_after < events[0].batch_size_after  # the unfreeze needs more memory per sample
