"""Loaders combined by the user: probed as Lightning's loops iterate them, and capped by their datasets.

A ``train_dataloader()`` that returns a ``CombinedLoader`` (any mode Lightning's fit loop accepts;
it refuses ``sequential`` itself) gave retune's probes ``(batch, batch_idx, dataloader_idx)``
tuples on 2.x instead of the combined batch. The steps here raise the real
``torch.OutOfMemoryError`` above ``CAPACITY`` samples in a step, summed over the combined batch's
parts (an oracle: no GPU here), and record what they were given, in probes and in real steps alike.
The dataset-length cap (a batch cannot hold more samples than the largest dataset) returned None
for a ``CombinedLoader`` and nested eval loaders, so the search doubled up to ``max_val``.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import ScheduledBatchSizeFinder
from retune.compat.combined_loaders import dataset_length, leaf_loaders
from tests.helpers.lightning_ns import LEGACY, NAMESPACE, pl, seed
from tests.helpers.retune_warnings import retune_warnings

CAPACITY = 40  # samples one step can hold, over all parts of a combined batch
SEARCH = {"mode": "binsearch", "margin": 0.0, "steps_per_trial": 2, "init_val": 2, "max_val": 8192}
MODES = ["max_size_cycle", "min_size"] if LEGACY else ["max_size_cycle", "min_size", "max_size"]


def combined_loader_class() -> Any:
    module = "pytorch_lightning.trainer.supporters" if LEGACY else NAMESPACE + ".utilities.combined_loader"
    return importlib.import_module(module).CombinedLoader


def _data(n: int, seed_: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed_)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def _parts(batch: Any) -> list[Any]:
    """The (x, y) parts of a combined batch: a dict or list of them, None for an exhausted loader."""
    if isinstance(batch, dict):
        return [part for value in batch.values() for part in _parts(value)]
    if isinstance(batch, list) and batch and not isinstance(batch[0], torch.Tensor):
        return [part for value in batch for part in _parts(value)]
    return [] if batch is None else [batch]


class Combined(pl.LightningModule):  # type: ignore[misc,name-defined]
    """Trains on two datasets at once (a small and a large one), through whatever ``loaders()`` returns."""

    def __init__(self, mode: str | None, sizes: tuple[int, int] = (48, 200), capacity: int = CAPACITY) -> None:
        super().__init__()
        self.mode = mode
        self.batch_size = 2
        self.capacity = capacity
        self.sets = [_data(sizes[0], 0), _data(sizes[1], 1)]
        self.net = nn.Linear(4, 1)
        self._batches: list[Any] = []  # the structure of every batch a training step received

    def train_dataloader(self) -> Any:
        loaders = {"small": DataLoader(self.sets[0], batch_size=self.batch_size)}
        loaders["large"] = DataLoader(self.sets[1], batch_size=self.batch_size)
        return loaders if self.mode is None else combined_loader_class()(loaders, self.mode)

    def training_step(self, batch: Any) -> torch.Tensor:
        self._batches.append(type(batch).__name__ if not isinstance(batch, dict) else sorted(batch))
        parts = _parts(batch)
        if sum(x.shape[0] for x, _ in parts) > self.capacity:
            raise torch.OutOfMemoryError("CUDA out of memory (test oracle)")
        return sum((F.mse_loss(self.net(x), y) for x, y in parts), torch.zeros(()))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(model: pl.LightningModule, **search: Any) -> ScheduledBatchSizeFinder:  # type: ignore[name-defined]
    finder = ScheduledBatchSizeFinder(
        {"search": {**SEARCH, **search}, "triggers": [{"kind": "fit_start"}]}, verbose=False, write_report=False
    )
    trainer = pl.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[finder],
    )
    trainer.fit(model)
    assert trainer.state.finished
    return finder


@pytest.mark.parametrize("mode", MODES)
def test_a_users_combined_loader_is_probed_with_its_combined_batches(mode: str) -> None:
    seed(0)
    model = Combined(mode)
    finder = _fit(model)
    assert finder.batch_size == CAPACITY // 2  # both parts of every probe batch count
    assert model._batches and all(b == ["large", "small"] for b in model._batches), model._batches[:4]
    trials = finder.history[0].trials
    # two steps per trial that fit, one for a trial that ran out of memory, then the 2 real steps
    assert len(model._batches) == sum(2 if t.fits else 1 for t in trials) + 2


def test_a_dict_of_loaders_is_combined_as_the_fit_loop_combines_it() -> None:
    seed(0)
    model = Combined(None)
    assert _fit(model).batch_size == CAPACITY // 2
    assert all(b == ["large", "small"] for b in model._batches)


@pytest.mark.parametrize("mode", MODES)
def test_the_largest_combined_dataset_caps_the_search(mode: str) -> None:
    """Memory never runs out here: the search stops at the largest dataset's length (200), not at max_val."""
    seed(0)
    model = Combined(mode, capacity=10**9)
    finder = _fit(model)
    assert finder.batch_size == 200
    assert max(t.batch_size for t in finder.history[0].trials) == 200


@pytest.mark.skipif(LEGACY, reason="Lightning 1.9 has no max_size mode")
def test_max_size_probes_see_none_for_an_exhausted_loader_as_training_does() -> None:
    """``max_size`` gives None for a loader that has run out; a probe that outlasts the small one sees it too."""
    seed(0)
    model = Combined("max_size", sizes=(4, 200), capacity=10**9)
    seen: list[bool] = []
    original = model.training_step

    def step(batch: Any) -> torch.Tensor:
        seen.append(batch["small"] is None)
        return original(batch)

    model.training_step = step  # type: ignore[method-assign]
    _fit(model, max_val=2, steps_per_trial=4)  # 4 samples of "small" fill 2 batches of 2; then None
    assert seen[:4] == [False, False, True, True], seen


# -- the cap, alone --------------------------------------------------------------------------------


def test_dataset_length_finds_loaders_in_any_nesting_and_combined_loaders() -> None:
    a, b, c = (DataLoader(_data(n, 0), batch_size=2) for n in (10, 30, 20))
    assert dataset_length({"x": [a, b], "y": c}, world_size=1) == 30
    assert dataset_length([[a], (c,)], world_size=2) == 10  # per rank: ceil(20 / 2)
    assert dataset_length(combined_loader_class()({"x": a, "y": [b, c]}, "max_size_cycle"), world_size=1) == 30
    assert dataset_length(combined_loader_class()([a, c], "min_size"), world_size=1) == 20
    assert leaf_loaders({"x": [a, b], "y": c}) == [a, b, c]


def test_the_cap_is_what_the_sampler_draws_per_epoch_not_the_dataset() -> None:
    """No batch holds more than one epoch's draws: a subset, a weighted sampler's ``num_samples``, a
    ``RandomSampler``'s; a ``DistributedSampler`` of the user's own is one rank's shard already (Lightning keeps it),
    any other sampler is divided among the ranks Lightning shards it across (before: ``len(dataset)`` for all)."""
    data = _data(240, 0)
    subset = DataLoader(data, batch_size=2, sampler=torch.utils.data.SubsetRandomSampler(range(48)))
    weighted = DataLoader(data, batch_size=2, sampler=torch.utils.data.WeightedRandomSampler([1.0] * 240, 100))
    drawn = DataLoader(data, batch_size=2, sampler=torch.utils.data.RandomSampler(data, num_samples=30))
    shard = DataLoader(data, batch_size=2, sampler=torch.utils.data.DistributedSampler(data, num_replicas=4, rank=1))
    assert [dataset_length(d, world_size=1) for d in (subset, weighted, drawn, shard)] == [48, 100, 30, 60]
    assert [dataset_length(d, world_size=2) for d in (subset, weighted, drawn, shard)] == [24, 50, 15, 60]
    assert dataset_length({"a": subset, "b": drawn}, world_size=1) == 48  # the largest epoch among them
    # a batch sampler of the user's own without a sampler: the dataset's length (torch's placeholder sampler)
    own = DataLoader(data, batch_sampler=[[0, 1], [2, 3]])
    assert dataset_length(own, world_size=1) == 240


def test_an_iterable_dataset_anywhere_means_no_cap() -> None:
    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(range(4))

    a = DataLoader(_data(10, 0), batch_size=2)
    assert dataset_length({"x": a, "y": [DataLoader(Stream(), batch_size=2)]}, world_size=1) is None


# -- nested evaluation loaders -----------------------------------------------------------------------


class NestedVal(pl.LightningModule):  # type: ignore[misc,name-defined]
    """Validation over nested loaders (2.x flattens them and runs them one after another)."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 2
        self.val_batch_size = 2
        self.net = nn.Linear(4, 1)
        self.sets = [_data(n, i) for i, n in enumerate((10, 30, 20))]
        self._seen: list[tuple[int, int]] = []  # (dataloader_idx, batch size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.sets[0], batch_size=self.batch_size)

    def val_dataloader(self) -> Any:
        a, b, c = (DataLoader(s, batch_size=self.val_batch_size) for s in self.sets)
        return {"first": [a, b], "second": c}

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._seen.append((dataloader_idx, batch[0].shape[0]))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.skipif(LEGACY, reason="Lightning 1.9 fails on a dict of eval loaders")
def test_nested_eval_loaders_are_capped_by_their_largest_dataset() -> None:
    seed(0)
    model = NestedVal()
    schedule = {"search": SEARCH, "triggers": [{"kind": "fit_start"}], "stages": ["val"]}
    finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[finder])
    trainer.validate(model, verbose=False)
    assert finder.batch_sizes["val"] == 30
    trials = finder.history[0].trials
    assert max(t.batch_size for t in trials) == 30, trials
    assert {idx for idx, _ in model._seen} == {0, 1, 2}  # every loader probed and validated, in turn


@pytest.mark.skipif(LEGACY, reason="1.9's CombinedLoader keeps its loaders wrapped; it probes the first batches")
def test_probe_samples_largest_picks_each_combined_loaders_largest_samples() -> None:
    """``probe_samples: largest`` reorders every loader inside the user's CombinedLoader (a copy of it)."""

    class Indexed(Combined):
        def __init__(self) -> None:
            super().__init__("max_size_cycle", capacity=10**9)
            for data in self.sets:
                data.tensors[0][:, 0] = torch.arange(len(data), dtype=torch.float32)  # feature 0: the index
            self._firsts: list[dict[str, list[int]]] = []

        def training_step(self, batch: Any) -> torch.Tensor:
            self._firsts.append({key: batch[key][0][:, 0].int().tolist() for key in ("small", "large")})
            return super().training_step(batch)

    seed(0)
    model = Indexed()
    finder = ScheduledBatchSizeFinder(
        {
            "search": {**SEARCH, "max_val": 4, "steps_per_trial": 1, "probe_samples": "largest"},
            "triggers": [{"kind": "fit_start"}],
        },
        verbose=False,
        write_report=False,
        sample_size=lambda sample: int(sample[0][0]),  # a sample's size is its index: the last ones are largest
    )
    with retune_warnings() as said:
        pl.Trainer(
            max_epochs=1,
            limit_train_batches=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[finder],
        ).fit(model)
    assert not [m for m in said if "cannot pick" in m], said
    assert model._firsts[0] == {"small": [47, 46], "large": [199, 198]}  # the trial at size 2
    assert model._firsts[-1] == {"small": [0, 1, 2, 3], "large": [0, 1, 2, 3]}  # the real step: the hook's order
