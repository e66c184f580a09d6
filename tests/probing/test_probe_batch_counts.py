"""What a probe's batches hold: ``largest`` batches the epoch can produce, and every batch's samples counted.

``probe_samples: largest`` filled a batch above the sampler's candidates by repeating them (142 samples built
from 48) where the epoch never repeats a sample; and nothing counted what a probe's batches held, so a size
that no batch held (a batch sampler of the user's own, a sampler that draws fewer samples) was "verified".
"""

from __future__ import annotations

import doctest
from typing import Any

import torch
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

import retune.probing.probe_batches
from retune.probing.probe_batches import HeldSizes, ProbeBatches, counted, probe_batch


def _data(n: int = 40) -> TensorDataset:
    return TensorDataset(torch.arange(n), torch.arange(n).float())


def test_doctests() -> None:
    outcome = doctest.testmod(retune.probing.probe_batches)
    assert outcome.attempted > 0 and outcome.failed == 0


def test_a_largest_batch_never_repeats_a_sample_the_epoch_draws_once() -> None:
    chosen = [7, 3, 9]
    assert probe_batch(chosen, 2, 3) == [7, 3]
    assert probe_batch(chosen, 8, 3) == chosen  # no replacement: the three, once (the search hears it held 3)
    assert probe_batch(chosen, 8, None) == chosen  # a sampler without a length: not assumed to repeat
    # with replacement (100 draws of 3 samples) a batch of 8 can hold them again: the largest first
    assert probe_batch(chosen, 8, 100) == [7, 3, 9, 7, 3, 9, 7, 3]
    assert probe_batch(chosen, 8, 5) == [7, 3, 9, 7, 3]  # no batch holds more than an epoch's draws


def test_largest_batches_over_a_subset_hold_its_samples_once_each() -> None:
    """48 candidates probed at 64: each probe batch is the 48 (before: 64 and 16, the 48 repeated)."""
    data = _data(240)
    loader = DataLoader(data, batch_size=64, sampler=SubsetRandomSampler(list(range(0, 240, 5))))
    arranged = ProbeBatches("largest", sample_size=lambda sample: int(sample[0]), say=lambda *a, **k: None).arrange(
        loader, "train", steps=2
    )
    batches = [index.tolist() for index, _ in arranged]
    assert [len(b) for b in batches] == [48, 48]
    assert all(len(set(b)) == 48 and set(b) == set(range(0, 240, 5)) for b in batches)


def test_counting_sees_each_batchs_samples_and_leaves_the_users_loader_alone() -> None:
    loader = DataLoader(_data(), batch_size=16)
    seen: list[int] = []
    copy = counted(loader, seen)
    assert [len(index) for index, _ in copy] == [16, 16, 8]
    assert seen == [16, 16, 8]
    assert copy is not loader and type(loader.batch_sampler).__name__ == "BatchSampler"
    assert len(copy) == 3 and copy.batch_sampler.batch_size == 16  # the batch sampler's attributes are its own

    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(range(5))

    stream = DataLoader(Stream(), batch_size=4)
    assert counted(stream, seen) is stream  # placeholder indices say nothing of what the stream had left


def test_arrange_with_a_size_records_what_its_batches_held() -> None:
    probes = ProbeBatches("first", say=lambda *a, **k: None)
    for size in (16, 64):
        for _ in probes.arrange(DataLoader(_data(), batch_size=size), "train", steps=1, size=size):
            pass
    assert probes.held.by_size == {16: [16, 16, 8], 64: [40]}
    assert probes.held.mismatched() == {64: (40, 40)}  # 16's short last batch is no mismatch
    assert probes.held.verified_cap([16, 64]) == 40
    assert "probes at 64 ran batches of 40 samples" in probes.held.describe()


def test_held_sizes_cap_only_where_a_probe_missed_its_size() -> None:
    held = HeldSizes()
    held.record(8, "x").extend([8, 8, 3])
    assert held.verified_cap([8]) is None
    held.record(32, "its batch_sampler (TokenBudget) decides which samples go together").extend([9, 11, 7])
    assert held.verified_cap([8, 32]) == 11
    assert held.verified_cap([8]) == 8  # a fitting probe held 8, the 32 failed
    assert "TokenBudget" in held.describe() and "7-11 samples" in held.describe()
    assert held.first_warning("train") and not held.first_warning("train")
    held.clear()
    assert held.verified_cap([8]) is None and not held.first_warning("train")  # warned once per fit
