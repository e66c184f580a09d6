"""Variable-length token data with pad-to-longest batching, shared by the probe_samples tests and benchmark.

The data is what makes a size found on the first batches wrong for the epoch: most samples are
``BASE_LEN`` tokens, a few (0.25%) are ``LONG_FACTOR`` times longer, and ``collate_fn`` pads every
batch to its longest sample, so a batch that holds one long sample needs about ``LONG_FACTOR`` times
the memory of one that does not. The long samples sit past the first batches (as they would in any
order a few times out of four), where probes on the first batches never see them.

:class:`StepPeaks` measures every real training step of a fit the way a probe is measured
(``retune.memory.measure_peak`` around the step, plus the batch's own bytes on CPU).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from retune.memory import measure_peak, tensor_bytes
from tests.helpers.lightning_ns import PRECISION_32, pl

N_SAMPLES = 1200
BASE_LEN = 16
LONG_FACTOR = 8
LONG_AT = (830, 1010, 1150)  # 0.25% of 1200, all past the first 780 samples
VOCAB = 512
BUDGET = "6MiB"


class TokenDataset(Dataset[dict[str, Any]]):
    """``{"input_ids": LongTensor[length], "label": int}``; lengths from ``lengths`` (one per sample)."""

    def __init__(self, lengths: list[int], seed: int = 0, augment: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
        self.labels = torch.randint(0, 4, (len(lengths),), generator=g).tolist()
        self.augment = augment
        self.reads = 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.reads += 1
        ids = self.rows[index]
        if self.augment:  # token dropout drawing from torch's, Python's and NumPy's global RNG
            ids = ids.clone()
            ids[int(torch.randint(0, len(ids), ()))] = 1 + int(random.random() * 3) + int(np.random.randint(0, 3))
        return {"input_ids": ids, "label": self.labels[index]}


def token_count(sample: dict[str, Any]) -> int:
    """A ``sample_size`` function: the number of tokens (what padding grows with)."""
    return len(sample["input_ids"])


def shortest_first(sample: dict[str, Any]) -> int:
    """A deliberately wrong ``sample_size``: ranks the shortest samples as the largest."""
    return 10_000 - len(sample["input_ids"])


def lengths(n: int = N_SAMPLES, long_at: tuple[int, ...] = LONG_AT) -> list[int]:
    return [BASE_LEN * LONG_FACTOR if i in long_at else BASE_LEN for i in range(n)]


def pad_collate(samples: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad to the longest sample of the batch (dynamic padding), as text collators do."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, : len(sample["input_ids"])] = sample["input_ids"]
    return ids, torch.tensor([s["label"] for s in samples])


class TokenClassifier(pl.LightningModule):  # type: ignore[misc]
    """Embedding, a per-token MLP, mean over tokens, a linear head; AdamW. Memory follows batch x longest."""

    def __init__(self, data: Dataset[Any], batch_size: int = 8, shuffle: bool = False, seed: int = 0) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.mlp = nn.Sequential(nn.Linear(32, 96), nn.GELU(), nn.Linear(96, 32))
        self.head = nn.Linear(32, 4)
        self.data = data
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.generator = torch.Generator().manual_seed(seed) if shuffle else None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels = batch
        hidden = self.mlp(self.embed(ids))
        mask = (ids > 0).unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return F.cross_entropy(self.head(pooled), labels)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(
            self.data,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            collate_fn=pad_collate,
            generator=self.generator,
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepPeaks(pl.Callback):  # type: ignore[misc]
    """The peak of every real training step, measured as a probe is: ``measure_peak`` from the step's
    start (after the device transfer) to its end, plus the batch's bytes on CPU."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self.sizes: list[int] = []
        self._open: Any = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._open = measure_peak(pl_module.device, pl_module, list(trainer.optimizers), grads=True)
        self._reading = self._open.__enter__()
        self._batch_bytes = tensor_bytes(batch)
        self.sizes.append(int(batch[0].shape[0]))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._open.__exit__(None, None, None)
        self._open = None
        self.peaks.append(int(self._reading.peak_bytes) + self._batch_bytes)


class SeenBatches(pl.Callback):  # type: ignore[misc]
    """The token ids of every real batch (probe steps are hidden from callbacks), for order checks."""

    def __init__(self) -> None:
        self.seen: list[list[list[int]]] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(batch[0].tolist())


def trainer(callbacks: list[Any], epochs: int = 1, **kwargs: Any) -> Any:
    """A quiet one-device CPU trainer (no logger, checkpoints, progress bar, summary or sanity check) for the
    tests; ``kwargs`` add or override Trainer arguments."""
    options: dict[str, Any] = {
        "max_epochs": epochs,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "precision": PRECISION_32,
        "accelerator": "cpu",
        "devices": 1,
    }
    options.update(kwargs)
    return pl.Trainer(callbacks=callbacks, **options)


def schedule(probe_samples: str, **search: Any) -> dict[str, Any]:
    return {
        "triggers": [{"kind": "fit_start"}],
        "search": {"mode": "binsearch", "margin": 0.0, "probe_samples": probe_samples, **search},
        "memory": {"budget": BUDGET},
    }
