"""Long-tailed token data and a small model for the ``batching: buckets`` tests, DDP script and benchmark.

Most samples are short (8-32 tokens), a few percent are long (200-256), and ``collate_fn`` pads to
the batch's longest sample, so a step's memory follows ``batch x longest``: one batch size must fit
the long tail, while buckets let the short majority train in far larger batches. Every batch carries
its samples' dataset indices, so tests can check that each sample trains once per epoch.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests.helpers.lightning_ns import pl
from tests.helpers.varlen import TokenDataset, token_count
from tests.helpers.varlen import pad_collate as pad_tokens
from tests.helpers.varlen import trainer as quiet_trainer

VOCAB = 512  # the same as tests/helpers/varlen.py, whose TokenDataset draws the tokens
BUDGET = "5MiB"


def long_tail_lengths(n: int, seed: int = 0, tail: float = 0.03, longest: tuple[int, int] = (200, 256)) -> list[int]:
    """``n`` lengths: 8-32 tokens, a share ``tail`` drawn from ``longest`` instead."""
    r = random.Random(seed)
    return [r.randint(*longest) if r.random() < tail else r.randint(8, 32) for _ in range(n)]


LONG_TAIL_BY_STEPS = {"tail": 0.05, "longest": (600, 1200)}
"""A tail that trains one or two samples to a batch under the 5 MiB budget: where its bucket is cut decides how
many go two at a time (``search.predict: auto`` cuts it by steps, tests/buckets/test_plan_by_steps.py)."""


class IndexedTokens(TokenDataset):
    """tests/helpers/varlen.py's ``TokenDataset`` with each sample's dataset index.

    Items are ``{"input_ids", "label", "index"}``.
    """

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {**super().__getitem__(index), "index": index}


tokens = token_count
"""``sample_size``: a sample's tokens."""


def pad_collate(samples: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tests/helpers/varlen.py's padding collate, plus the samples' dataset indices."""
    ids, labels = pad_tokens(samples)
    return ids, labels, torch.tensor([s["index"] for s in samples])


class BucketModel(pl.LightningModule):  # type: ignore[misc]
    """Embedding -> per-token MLP (the "backbone") -> masked mean -> head; AdamW.

    ``frozen=True`` starts with the backbone frozen (``unfreeze()`` adds its gradients and optimizer
    state). ``batches`` records every real batch's dataset indices.
    """

    def __init__(
        self,
        data: Dataset[Any],
        batch_size: int = 8,
        shuffle: bool = True,
        frozen: bool = False,
        drop_last: bool = False,
        width: int = 256,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.mlp = nn.Sequential(nn.Linear(32, width), nn.GELU(), nn.Linear(width, 32))
        self.head = nn.Linear(32, 4)
        self.data = data
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.batches: list[list[int]] = []
        if frozen:
            for module in (self.embed, self.mlp):
                module.requires_grad_(False)

    def unfreeze(self) -> None:
        for module in (self.embed, self.mlp):
            module.requires_grad_(True)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, labels, _ = batch
        hidden = self.mlp(self.embed(ids))
        mask = (ids > 0).unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return F.cross_entropy(self.head(pooled), labels)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.batches.append(batch[2].tolist())

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(
            self.data,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            collate_fn=pad_collate,
            drop_last=self.drop_last,
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # every parameter from the start (frozen ones get no gradient, so no state, until unfrozen)
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class UnfreezeAt(pl.Callback):  # type: ignore[misc]
    """Unfreezes the backbone at the start of an epoch (before retune's search: retune runs last)."""

    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch == self.epoch:
            pl_module.unfreeze()


class Curriculum(IndexedTokens):
    """Texts cut at ``max_len`` when read; a length curriculum raises ``max_len`` on this same object."""

    def __init__(self, lengths: list[int], max_len: int) -> None:
        super().__init__(lengths)
        self.max_len = max_len

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = super().__getitem__(index)
        return {**sample, "input_ids": sample["input_ids"][: self.max_len]}


class RaiseMaxLen(pl.Callback):  # type: ignore[misc]
    """The user's curriculum: at the start of epoch ``at``, ``max_len`` becomes ``to`` (retune's hooks run after)."""

    def __init__(self, data: Curriculum, at: int, to: int) -> None:
        self.data, self.at, self.to = data, at, to

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch == self.at:
            self.data.max_len = self.to


def trainer(callbacks: list[Any], epochs: int = 1, **kwargs: Any) -> Any:
    """tests/helpers/varlen.py's quiet CPU trainer (``kwargs`` add or override Trainer arguments)."""
    return quiet_trainer(callbacks, epochs, **kwargs)


class RebuiltCurriculum(BucketModel):
    """A model whose ``train_dataloader()`` builds a new ``Curriculum`` over ``lengths`` every epoch (Lightning's
    ``reload_dataloaders_every_n_epochs=1``): cut at ``before`` tokens until epoch ``at``, at ``after`` from then on."""

    def __init__(self, lengths: list[int], at: int = 2, before: int = 64, after: int = 256) -> None:
        super().__init__(Curriculum(lengths, before))
        self.lengths, self.at, self.before, self.after = lengths, at, before, after

    def train_dataloader(self) -> DataLoader[Any]:
        cut = self.before if self.trainer.current_epoch < self.at else self.after
        self.data = Curriculum(self.lengths, max_len=cut)  # a new object every epoch
        return super().train_dataloader()


class ReadsPerEpoch(pl.Callback):  # type: ignore[misc]
    """How many samples ``data`` had read by the end of each epoch (``data.reads``, cumulative)."""

    def __init__(self, data: Any) -> None:
        self.data, self.reads = data, []

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.reads.append(self.data.reads)


def schedule(**search: Any) -> dict[str, Any]:
    settings = {"batching": "buckets", "buckets": 4, "steps_per_trial": 2, **search}
    if settings["batching"] == "fixed":
        del settings["buckets"]  # batching: fixed makes no buckets (a schedule that sets them is refused)
    return {
        "triggers": [{"kind": "fit_start"}, {"kind": "trainable_params_changed"}],
        "search": settings,
        "memory": {"budget": BUDGET},
    }


@dataclass(frozen=True)
class PaddedStepTime:
    """A step's seconds as a known function of its padded tokens ``T = batch x longest`` (tests/helpers/step_time.py's
    oracle, in tokens): ``fixed + per_token x T`` up to ``knee`` tokens, then each further token costs ``crowded``.

    Tokens per second, and so every bucket's samples per second, peak at ``knee`` padded tokens per step. With
    the backbone unfrozen the per-token costs grow by ``unfrozen_cost`` and the knee moves to ``knee_unfrozen``.
    The first step of a probe trial takes ``warmup`` seconds more (never timed).
    """

    fixed: float = 0.010
    per_token: float = 0.00001
    knee: int = 1024
    crowded: float = 0.00003
    unfrozen_cost: float = 0.0
    knee_unfrozen: int | None = None
    warmup: float = 1.0

    def seconds(self, tokens: int, unfrozen: bool = False) -> float:
        scale = 1 + (self.unfrozen_cost if unfrozen else 0.0)
        knee = self.knee_unfrozen if unfrozen and self.knee_unfrozen is not None else self.knee
        return self.fixed + scale * (self.per_token * min(tokens, knee) + self.crowded * max(0, tokens - knee))

    def rate(self, batch: int, longest: int, unfrozen: bool = False) -> float:
        """Samples per second of a batch of ``batch`` samples padded to ``longest``."""
        return batch / self.seconds(batch * longest, unfrozen)


class TimedBucketModel(BucketModel):
    """``BucketModel`` whose every training step takes ``times.seconds(padded tokens)`` on ``clock``
    (a ``tests.helpers.step_time.FakeClock`` the finder reads: ``ScheduledBatchSizeFinder(..., clock=clock)``)."""

    def __init__(self, data: Dataset[Any], clock: Any, times: PaddedStepTime, **kwargs: Any) -> None:
        super().__init__(data, **kwargs)
        self.clock, self.times = clock, times

    def unfrozen(self) -> bool:
        return bool(next(self.mlp.parameters()).requires_grad)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        warm = self.times.warmup if batch_idx == 0 else 0.0  # a probe trial's first step warms up
        self.clock.advance(self.times.seconds(int(batch[0].numel()), self.unfrozen()) + warm)
        return loss


def check_rank_steps(ranks: list[dict[str, Any]], epoch: int, n: int) -> None:
    """Two ranks' recorded steps of ``epoch`` (tests/ddp/run_ddp_buckets.py's ``Record``) under bucketed
    batches: the same number of batches, the same bucket at every step, every sample of the ``n`` once
    across ranks (up to the padding of each bucket's last round), one shard per rank at each step."""
    steps = [[s for s in r["steps"] if s["epoch"] == epoch] for r in ranks]
    assert len(steps[0]) == len(steps[1]) > 0
    assert [s["bucket"] for s in steps[0]] == [s["bucket"] for s in steps[1]]
    assert all(s["bucket"] is not None for s in steps[0])
    seen = Counter(i for rank in steps for s in rank for i in s["indices"])
    assert set(seen) == set(range(n))
    buckets = len(ranks[0]["history"][0]["bucket_sizes"])
    assert sum(c - 1 for c in seen.values()) < buckets, "at most one padded sample per bucket's last round"
    # the two ranks' samples at a step are disjoint (one shard each), but for the one sample that pads a
    # bucket's last round when it is odd (it can be from the same round, when the bucket is that round)
    for a, b in zip(steps[0], steps[1], strict=True):
        assert len(set(a["indices"]) & set(b["indices"])) <= 1


def unverified_buckets(event: Any) -> list[int]:
    """The buckets of a search event whose size no real probe verified: a size is used only at or below one a
    probe found to fit, in its bucket or one of longer samples (a size that fits longer samples fits shorter)."""
    unverified = []
    for bucket, size in enumerate(event.bucket_sizes):
        verified = [
            t.batch_size
            for t, b in zip(event.trials, event.trial_buckets, strict=True)
            if t.fits and event.bucket_bounds[b] >= event.bucket_bounds[bucket]
        ]
        if max(verified, default=0) < size:
            unverified.append(bucket)
    return unverified


class IndicesByEpoch(pl.Callback):  # type: ignore[misc]
    """The dataset indices ``training_step`` saw (``IndexedTokens``' third field), per epoch, as a multiset: what a
    comparison with a plain run's epochs reads (buckets regroup the samples, so the order differs)."""

    def __init__(self) -> None:
        self.epochs: dict[int, Counter[int]] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.epochs.setdefault(int(trainer.current_epoch), Counter()).update(batch[2].tolist())
