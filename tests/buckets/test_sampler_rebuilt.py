"""A choosing sampler under a loader that Lightning rebuilds every epoch trains what a plain run trains.

With ``reload_dataloaders_every_n_epochs`` Lightning calls ``train_dataloader()`` at each epoch start and asks
the new loader's length, which is when a bucketed loader over a choosing sampler draws the epoch (one pass over
the user's sampler: :class:`retune.buckets.drawn.DrawnBucketBatchSampler`). Two ways that went wrong, both found
by a review and both checked here against a plain Lightning run of the same code (no retune), epoch by epoch,
as multisets of the dataset indices ``training_step`` saw:

* **A second pass at the same epoch start.** When the rebuilt data's sizes changed, retune regroups (or
  searches) at that epoch start and rebuilds the loader once more; its length was asked again and the user's
  sampler drew a second pass. The epoch trained that pass and the first was never trained: a stateful sampler
  that covers the data in chunks trained 100 of 200 samples over four epochs, a weighted sampler on a generator
  kept on the module trained passes 0, 2, 4, 6 where a plain run trains 0, 1, 2, 3. Now the rebuilt loader
  groups the draws the epoch already made.
* **A dataset that grew.** The buckets were kept for a rebuilt dataset whenever their indices still existed in
  it, so a choosing sampler drew the new samples, which no bucket held, and the run stopped with a
  ``RetuneError`` at the first epoch after the growth. Now a dataset of another length is regrouped first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler, WeightedRandomSampler

from retune import ScheduledBatchSizeFinder
from tests.helpers import bucket_data
from tests.helpers.bucket_data import BucketModel, IndexedTokens, IndicesByEpoch, long_tail_lengths, pad_collate, tokens
from tests.helpers.lightning_ns import pl, seed

N = 200


class Chunks(Sampler[int]):
    """A stateful sampler: each pass yields the next 50 of the dataset's positions (a cursor, no generator)."""

    def __init__(self, n: int, chunk: int = 50) -> None:
        self.n, self.chunk, self.cursor = n, chunk, 0

    def __iter__(self) -> Iterator[int]:
        start = self.cursor
        self.cursor = (self.cursor + self.chunk) % self.n
        return iter(range(start, start + self.chunk))

    def __len__(self) -> int:
        return self.chunk


class Rebuilt(BucketModel):
    """``train_dataloader()`` builds a new dataset every epoch (other sample sizes; ``lengths[epoch]`` samples)
    and a loader over ``make_sampler(self)``."""

    def __init__(self, lengths: list[int], make_sampler: Callable[[Any], Sampler[int]]) -> None:
        super().__init__(IndexedTokens(long_tail_lengths(lengths[0])), batch_size=8)
        self.lengths, self.make_sampler = lengths, make_sampler
        self.generator = torch.Generator().manual_seed(11)  # kept on the module: the user's draws go on in sequence
        self.chunks = Chunks(N)

    def train_dataloader(self) -> DataLoader[Any]:
        epoch = self.trainer.current_epoch
        self.data = IndexedTokens(long_tail_lengths(self.lengths[epoch], seed=epoch))
        sampler = self.make_sampler(self)
        return DataLoader(self.data, batch_size=self.batch_size, sampler=sampler, collate_fn=pad_collate)


def _fit(lengths: list[int], make_sampler: Callable[[Any], Sampler[int]], retune: bool) -> tuple[IndicesByEpoch, Any]:
    seed(0)
    seen = IndicesByEpoch()
    callbacks: list[Any] = [seen]
    finder = None
    if retune:
        finder = ScheduledBatchSizeFinder(bucket_data.schedule(), sample_size=tokens, verbose=False, write_report=False)
        callbacks.append(finder)
    trainer = bucket_data.trainer(callbacks, epochs=len(lengths), reload_dataloaders_every_n_epochs=1)
    trainer.fit(Rebuilt(lengths, make_sampler))
    return seen, finder


def _same_as_plain(lengths: list[int], make_sampler: Callable[[Any], Sampler[int]]) -> tuple[IndicesByEpoch, Any]:
    plain, _ = _fit(lengths, make_sampler, retune=False)
    tuned, finder = _fit(lengths, make_sampler, retune=True)
    assert sorted(tuned.epochs) == sorted(plain.epochs) == list(range(len(lengths)))
    for epoch in plain.epochs:
        assert tuned.epochs[epoch] == plain.epochs[epoch], epoch
    # bucketed, and regrouped at every rebuild (its sizes changed)
    assert finder is not None and len(set(finder.bucket_sizes)) > 1, finder.bucket_sizes
    assert [e.trigger for e in finder.history][1:] == ["data_changed"] * (len(lengths) - 1)
    return plain, finder


def test_a_stateful_sampler_trains_each_of_its_passes_once_when_the_loader_is_rebuilt_every_epoch() -> None:
    plain, _ = _same_as_plain([N] * 4, lambda model: model.chunks)
    covered = {index // 50 for counts in plain.epochs.values() for index in counts}
    assert covered == {0, 1, 2, 3}  # every chunk once: before, retune trained chunks 0, 2, 0, 2


def test_a_weighted_sampler_on_a_kept_generator_trains_its_next_pass_each_epoch() -> None:
    weights = torch.tensor([10.0 if i % 4 == 0 else 1.0 for i in range(N)])
    plain, _ = _same_as_plain([N] * 3, lambda model: WeightedRandomSampler(weights, 150, generator=model.generator))
    fresh = WeightedRandomSampler(weights, 150, generator=torch.Generator().manual_seed(11))
    passes = [Counter(int(i) for i in fresh) for _ in range(3)]
    assert [plain.epochs[epoch] for epoch in range(3)] == passes  # pass k at epoch k (before: passes 0, 2, 4)


def test_a_choosing_sampler_over_a_dataset_that_grows_trains_every_epoch() -> None:
    def weighted(model: Any) -> Sampler[int]:
        return WeightedRandomSampler(torch.ones(len(model.data)), 120, generator=torch.Generator().manual_seed(11))

    plain, _ = _same_as_plain([200, 260, 320], weighted)
    assert max(plain.epochs[2]) >= 260  # the grown part trains (before: a RetuneError at epoch 1)


class Longest(pl.Callback):  # type: ignore[misc]
    """The longest padded batch ``training_step`` saw, per epoch."""

    def __init__(self) -> None:
        self.longest: dict[int, int] = {}

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        epoch = int(trainer.current_epoch)
        self.longest[epoch] = max(self.longest.get(epoch, 0), int(batch[0].shape[1]))


def test_a_rebuild_by_retune_keeps_lightnings_reload_schedule() -> None:
    """Found by review: with ``reload_dataloaders_every_n_epochs=2`` and a re-search at epoch 1 that changed the
    sizes, retune's rebuild counted as Lightning's reload, so the next one came at epoch 3: epoch 2 trained the
    loader built at epoch 1, a curriculum's 64 tokens where a plain run trains 240. The rebuild now leaves the
    epoch of the schedule's last reload as it was."""
    from tests.helpers.bucket_data import RebuiltCurriculum, UnfreezeAt

    def fit(retune: bool) -> tuple[Longest, Any]:
        seed(0)
        seen = Longest()
        callbacks: list[Any] = [seen, UnfreezeAt(1)]
        finder = None
        if retune:
            schedule = bucket_data.schedule()
            finder = ScheduledBatchSizeFinder(schedule, sample_size=tokens, verbose=False, write_report=False)
            callbacks.append(finder)
        model = RebuiltCurriculum(long_tail_lengths(N), at=2, before=64, after=256)
        for module in (model.embed, model.mlp):
            module.requires_grad_(False)
        bucket_data.trainer(callbacks, epochs=4, reload_dataloaders_every_n_epochs=2).fit(model)
        return seen, finder

    plain, _ = fit(False)
    tuned, finder = fit(True)
    assert finder is not None
    assert [e.trigger for e in finder.history][:2] == ["fit_start", "trainable_params_changed"]
    assert finder.history[1].bucket_sizes != finder.history[0].bucket_sizes  # the re-search rebuilt the loader
    assert plain.longest[2] > 64  # the curriculum's second stage from epoch 2
    assert tuned.longest == plain.longest  # before: epoch 2 at 64 tokens
