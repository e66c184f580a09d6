"""``search.probe_samples``: a size the search finds must hold for every batch of the epoch.

The data (tests/helpers/varlen.py): 1200 token sequences, 0.25% of them 8x longer, padded to the longest of
each batch, all long ones past the first batches. Budgets are CPU budgets measured by retune's
``CpuPeakTracker``; every real step of the epoch is measured the same way (``StepPeaks``).
"""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, Sampler, SequentialSampler

from retune import ScheduledBatchSizeFinder, ScheduleError
from retune.errors import RetuneError
from retune.schedule.models import parse_byte_size
from tests.helpers import varlen
from tests.helpers.dist_utils import run_rank_scripts
from tests.helpers.lightning_ns import seed
from tests.helpers.retune_warnings import retune_warnings
from tests.helpers.varlen import (
    SeenBatches,
    StepPeaks,
    TokenClassifier,
    TokenDataset,
    lengths,
    pad_collate,
    schedule,
    token_count,
)

BUDGET = parse_byte_size(varlen.BUDGET)


def _fit(probe_samples: str, batch_size: int = 8, **finder: Any) -> tuple[ScheduledBatchSizeFinder, StepPeaks]:
    seed(0)
    search = finder.pop("search", {})
    retune = ScheduledBatchSizeFinder(schedule(probe_samples, **search), verbose=False, write_report=False, **finder)
    peaks = StepPeaks()
    varlen.trainer([retune, peaks]).fit(TokenClassifier(TokenDataset(lengths()), batch_size=batch_size))
    return retune, peaks


def _epoch_peaks(batch_size: int) -> list[int]:
    """Every real step's peak of one epoch at a fixed size, without retune."""
    seed(0)
    peaks = StepPeaks()
    varlen.trainer([peaks]).fit(TokenClassifier(TokenDataset(lengths()), batch_size=batch_size))
    return peaks.peaks


def test_largest_keeps_every_real_step_of_the_epoch_within_the_budget() -> None:
    finder, peaks = _fit("largest")
    size = finder.batch_size
    assert size is not None and len(peaks.peaks) == -(-varlen.N_SAMPLES // size)
    assert max(peaks.peaks) <= BUDGET, [p / BUDGET for p in peaks.peaks]
    # the largest size whose worst batch fits: binsearch with margin 0 resolves to one sample, and one
    # more sample per batch puts the epoch's worst step over the budget
    event = finder.history[0]
    assert (event.max_fitting, event.min_failing) == (size, size + 1)
    assert max(_epoch_peaks(size + 1)) > BUDGET


def test_first_probes_miss_the_long_samples_and_the_epoch_overflows() -> None:
    """Why the option exists: the first batches hold no long sample, so the size found is ~8x too large
    and the steps that meet a long sample need several times the budget (a mid-epoch OOM on a GPU)."""
    finder, peaks = _fit("first")
    largest, _ = _fit("largest")
    assert finder.batch_size is not None and largest.batch_size is not None
    assert finder.batch_size > 4 * largest.batch_size
    assert max(peaks.peaks) > 3 * BUDGET
    assert sum(p > BUDGET for p in peaks.peaks) >= 1


def test_sample_size_function_from_the_constructor_is_used() -> None:
    finder, _ = _fit("largest", sample_size=token_count)
    default, _ = _fit("largest")
    assert finder.batch_size == default.batch_size
    wrong, peaks = _fit("largest", sample_size=varlen.shortest_first)  # ranks the short samples first
    assert wrong.batch_size is not None and default.batch_size is not None
    assert wrong.batch_size > 4 * default.batch_size and max(peaks.peaks) > BUDGET


def test_sample_size_by_dotted_path_in_the_schedule() -> None:
    finder, peaks = _fit("largest", search={"sample_size": "tests.helpers.varlen.shortest_first"})
    assert finder.probe_batches.size_fn is varlen.shortest_first
    assert max(peaks.peaks) > BUDGET  # the schedule's function decided which samples were probed


def test_unknown_dotted_path_is_a_clear_error_at_construction() -> None:
    with pytest.raises(ScheduleError, match=r"search\.sample_size: cannot import module 'mypkg\.sizes'"):
        ScheduledBatchSizeFinder(schedule("largest", sample_size="mypkg.sizes.tokens"))
    message = r"search\.sample_size: 'tests\.helpers\.varlen\.BUDGET' is a str, not a function"
    with pytest.raises(ScheduleError, match=message):
        ScheduledBatchSizeFinder(schedule("largest", sample_size="tests.helpers.varlen.BUDGET"))
    with pytest.raises(RetuneError, match="sample_size must be a function"):
        ScheduledBatchSizeFinder(schedule("largest"), sample_size=3)  # type: ignore[arg-type]


class _Stream(IterableDataset):  # type: ignore[type-arg]
    def __init__(self, data: TokenDataset) -> None:
        self.data = data

    def __iter__(self) -> Any:
        return (self.data[i] for i in range(len(self.data)))


class _StreamModel(TokenClassifier):
    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(_Stream(self.data), batch_size=self.batch_size, collate_fn=pad_collate)


class _BucketSampler(BatchSampler):
    """Batches samples of equal length together (what a bucketing sampler does)."""


class _BucketModel(TokenClassifier):
    def train_dataloader(self) -> DataLoader[Any]:
        sampler = _BucketSampler(SequentialSampler(self.data), self.batch_size, drop_last=False)
        return DataLoader(self.data, batch_sampler=sampler, collate_fn=pad_collate)


class _Keyed(Dataset):  # type: ignore[type-arg]
    """A map-style dataset keyed by name, not position."""

    def __init__(self, data: TokenDataset) -> None:
        self.rows = {f"s{i}": data[i] for i in range(len(data))}

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, key: str) -> Any:
        return self.rows[key]


class _KeySampler(Sampler[str]):
    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    def __iter__(self) -> Any:
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


class _KeyedModel(TokenClassifier):
    def train_dataloader(self) -> DataLoader[Any]:
        keyed = _Keyed(self.data)
        sampler = _KeySampler(list(keyed.rows))
        return DataLoader(keyed, batch_size=self.batch_size, sampler=sampler, collate_fn=pad_collate)


@pytest.mark.parametrize(
    ("model_cls", "reason"),
    [
        (_StreamModel, "(_Stream) is an IterableDataset, so probes run on its first batches only and steps may exceed"),
        (_BucketModel, "its batch_sampler (_BucketSampler) decides which samples go together"),
        (_KeyedModel, "dataset[0] raised KeyError: 0; its sampler does not draw positions"),
    ],
)
def test_loaders_it_cannot_reorder_warn_once_and_probe_the_first_batches(
    model_cls: type[TokenClassifier], reason: str
) -> None:
    seed(0)
    data = TokenDataset(lengths(240, long_at=()))
    sched = schedule("largest")
    sched["triggers"].append({"kind": "epoch", "at": [1]})  # two searches, one warning
    finder = ScheduledBatchSizeFinder(sched, verbose=False, write_report=False)
    with retune_warnings() as said:
        varlen.trainer([finder], epochs=2, limit_train_batches=2).fit(model_cls(data, batch_size=4))
    warnings = [message for message in said if "probe_samples: largest cannot" in message]
    assert len(warnings) == 1 and reason in warnings[0], warnings
    assert len(finder.history) == 2 and finder.batch_size is not None  # searched on the first batches


@pytest.mark.parametrize("probe_samples", ["first", "largest"])
def test_a_stream_with_a_budget_warns_that_steps_may_exceed_it_and_what_to_do(probe_samples: str) -> None:
    """An IterableDataset under a memory.budget: the budget cannot be ensured, and the warning says so plainly."""
    seed(0)
    data = TokenDataset(lengths(240, long_at=()))
    finder = ScheduledBatchSizeFinder(schedule(probe_samples), verbose=False, write_report=False)
    with retune_warnings() as said:
        varlen.trainer([finder], epochs=1, limit_train_batches=2).fit(_StreamModel(data, batch_size=4))
    warnings = [message for message in said if "IterableDataset" in message]
    assert len(warnings) == 1, said
    for part in ("steps may exceed the memory budget", "map-style dataset", "probe_samples: largest", "`oom` trigger"):
        assert part in warnings[0], (part, warnings[0])


def test_first_warns_once_when_sizes_vary_widely() -> None:
    seed(0)
    rng = random.Random(0)
    wide = [rng.choice([4, 8, 16, 64]) for _ in range(240)]
    for data, warned in ((TokenDataset(wide), True), (TokenDataset(lengths(240, long_at=())), False)):
        sched = schedule("first")
        sched["triggers"].append({"kind": "epoch", "at": [1]})
        finder = ScheduledBatchSizeFinder(sched, verbose=False, write_report=False)
        with retune_warnings() as said:
            varlen.trainer([finder], epochs=2, limit_train_batches=1).fit(TokenClassifier(data, batch_size=4))
        hints = [message for message in said if "probe_samples: largest" in message]
        assert len(hints) == int(warned), hints
        if warned:
            assert "sizes vary widely (48 random samples: largest 65" in hints[0]


def test_the_scan_leaves_the_runs_data_order_and_rng_untouched() -> None:
    """A run whose search lands on its starting size ends bit-identical to the same run without retune:
    same shuffled order (the sampler's own generator), same augmentations (the dataset draws from torch's,
    Python's and NumPy's RNG in ``__getitem__``, which the scan calls for every sample), same weights."""
    finder, _ = _fit("largest")
    size = finder.batch_size
    assert size is not None

    def run(with_retune: bool) -> tuple[list[Any], list[torch.Tensor], tuple[Any, ...]]:
        seed(0)
        model = TokenClassifier(TokenDataset(lengths(), augment=True), batch_size=size, shuffle=True, seed=3)
        finder = ScheduledBatchSizeFinder(schedule("largest"), verbose=False, write_report=False)
        seen = SeenBatches()
        varlen.trainer([finder, seen] if with_retune else [seen], epochs=2).fit(model)
        if with_retune:
            assert [e.batch_size_after for e in finder.history] == [size]
            assert finder.probe_batches.cache.scans == 1
        after = (torch.rand(2).tolist(), random.random(), float(np.random.rand()), model.generator.get_state())
        return seen.seen, [p.detach().clone() for p in model.parameters()], after

    seen, params, after = run(with_retune=True)
    seen_ref, params_ref, after_ref = run(with_retune=False)
    assert seen == seen_ref
    assert all(torch.equal(a, b) for a, b in zip(params, params_ref, strict=True))
    assert after[:3] == after_ref[:3] and torch.equal(after[3], after_ref[3])


def test_the_callback_still_pickles_for_ddp_spawn() -> None:
    """``ddp_spawn`` pickles every callback; the size function travels by reference."""
    size_fn = "tests.helpers.varlen.token_count"
    finder = ScheduledBatchSizeFinder(schedule("largest", sample_size=size_fn), verbose=False)
    copy = pickle.loads(pickle.dumps(finder))
    assert copy.probe_batches.size_fn is token_count and copy.probe_batches.mode == "largest"


def test_ddp_ranks_probe_the_global_largest_and_every_rank_stays_within_the_budget(tmp_path: Path) -> None:
    """Two CPU ranks (gloo) in a subprocess with a timeout: each scans the whole dataset, both find the
    single-process size, and every real step of each rank's shuffled shard stays within the budget."""
    script = Path(__file__).resolve().parents[1] / "ddp" / "run_ddp_largest.py"
    # a session of its own, killed whole on a timeout below the suite's per-test one (tests/helpers/dist_utils.py)
    code, output, out = run_rank_scripts({"largest": ["{out}"]}, script, tmp_path, 240)["largest"]
    assert code == 0, output[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    single, _ = _fit("largest")
    assert [r["batch_size"] for r in ranks] == [single.batch_size] * 2
    assert ranks[0]["trials"] == ranks[1]["trials"]
    assert [r["scans"] for r in ranks] == [1, 1]
    assert all(max(r["peaks"]) <= BUDGET for r in ranks), [max(r["peaks"]) / BUDGET for r in ranks]


class _WithVal(TokenClassifier):
    """Validation on the same data through its own ``val_batch_size`` (so the val stage is tuned in fit)."""

    def __init__(self, data: TokenDataset) -> None:
        super().__init__(data)
        self.val_batch_size = 8
        self._val_batches: list[tuple[int, int]] = []  # per validation_step call: (rows, long rows)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        ids, _ = batch
        self._val_batches.append((ids.shape[0], int(((ids > 0).sum(1) > varlen.BASE_LEN).sum())))
        self.mlp(self.embed(ids))

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.val_batch_size, collate_fn=pad_collate)


def test_largest_applies_to_evaluation_stages_too() -> None:
    seed(0)
    sched = schedule("largest")
    sched["stages"] = ["train", "val"]
    finder = ScheduledBatchSizeFinder(sched, verbose=False, write_report=False)
    model = _WithVal(TokenDataset(lengths(240, long_at=(100, 200))))
    varlen.trainer([finder], limit_train_batches=1, limit_val_batches=1).fit(model)
    assert [e.stage for e in finder.history] == ["train", "val"]
    *probes, real = model._val_batches
    assert probes and all(long == min(2, rows) for rows, long in probes), probes  # the two long samples first
    assert real == (finder.batch_sizes["val"], 0)  # the real validation batch: the first samples
