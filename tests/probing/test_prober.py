"""The prober's trials: every trial starts from the state captured before the first one.

retune resets to its snapshot lazily, at the start of each trial after the first (and restores once
when the search ends), so a trial must never start from what the previous trial left behind.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune.probing.prober import Prober
from tests.helpers.lightning_ns import PRECISION_32, pl


class _Recording(pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        self.batch_size = 4
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
        self._starts: list[dict[str, torch.Tensor]] = []  # the state each training step starts from
        self.recording = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.recording:
            optimizer = self.trainer.optimizers[0]
            state = {f"param {i}": p.detach().clone() for i, p in enumerate(self.parameters())}
            for i, p in enumerate(self.parameters()):
                for key, value in optimizer.state.get(p, {}).items():
                    state[f"state {i} {key}"] = value.detach().clone()
            self._starts.append(state)
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1)


class _ProbeAtEpochOne(pl.Callback):  # type: ignore[misc]
    def __init__(self, sizes: list[int], steps: int) -> None:
        self.sizes, self.steps = sizes, steps
        self.captured: dict[str, torch.Tensor] = {}
        self.after: dict[str, torch.Tensor] = {}
        self.storages: tuple[list[int], list[int]] = ([], [])

    def on_train_epoch_start(self, trainer: Any, pl_module: _Recording) -> None:
        if trainer.current_epoch != 1:
            return
        pl_module.recording = True
        pl_module._starts.clear()
        self.storages[0].extend(p.data_ptr() for p in pl_module.parameters())
        prober = Prober(trainer, pl_module, "batch_size", self.steps, track_memory=False)
        with prober.session():
            for size in self.sizes:
                assert prober.fits(size)
        self.storages[1].extend(p.data_ptr() for p in pl_module.parameters())
        pl_module.batch_size = 4


def test_every_trial_starts_from_the_captured_state(tmp_path: Any) -> None:
    model, probe = _Recording(), _ProbeAtEpochOne(sizes=[8, 16, 4], steps=2)
    trainer = pl.Trainer(
        max_epochs=2,
        limit_train_batches=1,
        callbacks=[probe],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        precision=PRECISION_32,
        accelerator="cpu",
        devices=1,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(model)
    # 3 trials x 2 steps, then the epoch's own step; AdamW state exists from epoch 0's step
    assert len(model._starts) == 7
    captured = model._starts[0]
    assert any(key.startswith("state") for key in captured)
    for trial in range(3):
        first = model._starts[2 * trial]
        second = model._starts[2 * trial + 1]
        assert first.keys() == captured.keys()
        for key in captured:
            assert torch.equal(first[key], captured[key]), f"trial {trial} started from another state: {key}"
        assert not torch.equal(second["param 0"], captured["param 0"]), "the trial's steps do train"
    for key in captured:  # and the run's own step after the search
        assert torch.equal(model._starts[6][key], captured[key]), key
    assert probe.storages[0] == probe.storages[1], "the search hands back the parameters' own storage"
