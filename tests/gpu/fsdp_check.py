"""FSDP and DDP on a CUDA machine: what retune supports there, checked for real.

Not part of the default test run (no GPU in CI). Run on a machine with 1+ CUDA GPUs:

    python tests/gpu/fsdp_check.py            # uses every visible GPU

It checks that
  * under DDP (all visible GPUs) the finder searches with real CUDA OOM, every rank ends with the same
    batch size, and weights are identical across ranks after fit;
  * under FSDP the finder refuses at setup with a RetuneError that says why (probes run the unwrapped
    module, which FSDP does not keep whole), instead of probing wrongly or hanging.

The script needs retune's dependencies (pydantic, PyYAML): `pip install -e .` from the repository, or
`pip install "pydantic>=2.6,<3" pyyaml` and `PYTHONPATH=.` when the machine's torch must stay as it is.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import RetuneError, ScheduledBatchSizeFinder
from tests.helpers.lightning_ns import pl


class Wide(pl.LightningModule):  # type: ignore[misc,name-defined]
    """Big activations per sample so that real CUDA OOM comes at a few thousand samples."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 2
        self.net = nn.Sequential(
            nn.Linear(1024, 8192), nn.ReLU(), nn.Linear(8192, 8192), nn.ReLU(), nn.Linear(8192, 10)
        )
        self.data = TensorDataset(torch.randn(65536, 1024), torch.randint(0, 10, (65536,)))

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def run(strategy: str) -> None:
    model = Wide()
    finder = ScheduledBatchSizeFinder({"search": {"max_val": 65536}, "triggers": [{"kind": "fit_start"}]})
    trainer = pl.Trainer(
        accelerator="cuda",
        devices=-1,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=3,
        callbacks=[finder],
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model)
    weights = b"".join(p.detach().float().cpu().numpy().tobytes() for p in model.parameters())
    print(
        f"[{strategy} rank {trainer.global_rank}] batch size {finder.batch_size}, "
        f"trials {len(finder.history[0].trials)}, weights sha256 {hashlib.sha256(weights).hexdigest()[:16]}"
    )


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: run this on a GPU machine")
    run("ddp" if torch.cuda.device_count() > 1 else "auto")
    if torch.cuda.device_count() > 1:
        try:
            run("fsdp")
        except RetuneError as exc:
            print(f"[fsdp] refused as documented: {exc}")
        else:
            sys.exit("FSDP was expected to be refused with a RetuneError")


if __name__ == "__main__":
    main()
