"""The pure logic behind ``search.probe_samples: largest``: sizes, the largest-first order, the spread look,
the cache, and the loader copy that reads the chosen samples (no Lightning trainer involved)."""

from __future__ import annotations

import collections
import dataclasses
import json
import random
import subprocess
import sys
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, SubsetRandomSampler

from retune import ScheduleError, load_schedule
from retune.errors import RetuneError
from retune.probing.probe_batches import ProbeBatches, candidate_indices, why_not_reorderable, with_index_order
from retune.probing.sample_sizes import (
    FINGERPRINT_LARGEST,
    FINGERPRINT_SAMPLES,
    SizeCache,
    checked_size,
    default_sample_size,
    fingerprint_indices,
    preserved_rng,
    resolve_size_fn,
    scan_sizes,
    size_spread,
)
from tests.helpers.bucket_data import Curriculum
from tests.helpers.varlen import TokenDataset, pad_collate, token_count

# -- a sample's size ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Detection:
    image: torch.Tensor
    boxes: torch.Tensor
    name: str


class _Pair(NamedTuple):
    x: torch.Tensor
    y: int


class _Image:
    """Duck-typed like a PIL image: ``size`` is (width, height), ``getbands()`` the channels."""

    size = (20, 10)

    def getbands(self) -> tuple[str, ...]:
        return ("R", "G", "B")


def test_default_size_counts_elements_numbers_and_characters() -> None:
    assert default_sample_size(torch.zeros(3, 5)) == 15
    assert default_sample_size(np.zeros((2, 7))) == 14
    assert default_sample_size({"input_ids": torch.zeros(12), "attention_mask": torch.ones(12), "label": 3}) == 25
    assert default_sample_size(_Pair(torch.zeros(4), 1)) == 5
    assert default_sample_size([1, 2, 3, 4]) == 4  # token ids as a list: one each
    assert default_sample_size(np.int64(7)) == 1
    assert default_sample_size("a sentence") == 10  # a tokenizer in collate_fn: characters stand for tokens
    assert default_sample_size(b"abc") == 3
    assert default_sample_size(None) == 0
    assert default_sample_size(_Detection(torch.zeros(3, 8, 8), torch.zeros(5, 4), "img.jpg")) == 192 + 20 + 7
    assert default_sample_size(_Image()) == 600
    assert default_sample_size(object()) == 0


def test_default_size_walks_hugging_face_style_mappings_and_survives_cycles() -> None:
    class BatchEncoding(collections.UserDict):  # type: ignore[type-arg]
        pass

    assert default_sample_size(BatchEncoding(input_ids=[5, 6, 7], attention_mask=[1, 1, 1])) == 6
    loop: list[Any] = [torch.zeros(2)]
    loop.append(loop)
    assert default_sample_size(loop) == 2


def test_checked_size_accepts_ints_and_refuses_anything_else() -> None:
    assert checked_size(lambda s: np.int32(5), None, 0) == 5
    assert checked_size(lambda s: torch.tensor(6), None, 0) == 6
    with pytest.raises(RetuneError, match=r"returned 2.5 \(float\) for sample 3; it must return an int"):
        checked_size(lambda s: 2.5, None, 3)
    with pytest.raises(RetuneError, match="must return an int"):
        checked_size(lambda s: True, None, 0)
    with pytest.raises(RetuneError, match="returned -1 for sample 4; sizes must be >= 0"):
        checked_size(lambda s: -1, None, 4)


# -- the dotted path ------------------------------------------------------------------------------


def test_resolve_size_fn_by_dots_or_colon() -> None:
    assert resolve_size_fn("tests.helpers.varlen.token_count") is token_count
    assert resolve_size_fn("tests.helpers.varlen:token_count") is token_count
    assert resolve_size_fn("retune.probing.sample_sizes:default_sample_size") is default_sample_size


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_pkg_xyz.sizes.tokens", "cannot import module 'no_such_pkg_xyz.sizes'"),
        ("tests.helpers.varlen.no_such_fn", "module 'tests.helpers.varlen' has no attribute 'no_such_fn'"),
        ("tests.helpers.varlen.BUDGET", "'tests.helpers.varlen.BUDGET' is a str, not a function"),
        ("tokens", "not a dotted path"),
    ],
)
def test_resolve_size_fn_says_what_failed(path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        resolve_size_fn(path)


def test_schedule_fields_are_validated() -> None:
    search = load_schedule({"triggers": [{"kind": "fit_start"}]}).search
    assert (search.probe_samples, search.sample_size, search.scan_limit) == ("first", None, None)
    with pytest.raises(ScheduleError, match=r"search\.probe_samples.*'longest'"):
        load_schedule({"triggers": [{"kind": "fit_start"}], "search": {"probe_samples": "longest"}})
    with pytest.raises(ScheduleError, match=r"search\.sample_size.*'tokens; rm -rf' is not a dotted path"):
        load_schedule({"triggers": [{"kind": "fit_start"}], "search": {"sample_size": "tokens; rm -rf"}})
    with pytest.raises(ScheduleError, match=r"search\.scan_limit"):
        load_schedule({"triggers": [{"kind": "fit_start"}], "search": {"scan_limit": 0}})


def test_schema_shows_the_new_fields() -> None:
    out = subprocess.run([sys.executable, "-m", "retune", "schema"], capture_output=True, text=True, check=True)
    search = json.loads(out.stdout)["$defs"]["SearchConfig"]["properties"]
    assert search["probe_samples"]["enum"] == ["first", "largest"]
    assert {"sample_size", "scan_limit"} <= set(search)


def test_a_wrong_dotted_path_fails_when_the_schedule_is_loaded() -> None:
    """Validation imports the path (issue 28): the schedule never reaches the callback."""
    with pytest.raises(ScheduleError, match=r"search\.sample_size: module 'tests\.helpers\.varlen' has no attr"):
        load_schedule({"triggers": [{"kind": "fit_start"}], "search": {"sample_size": "tests.helpers.varlen.nope"}})
    size_fn = "tests.helpers.varlen.token_count"
    ok = load_schedule({"triggers": [{"kind": "fit_start"}], "search": {"sample_size": size_fn}})
    assert ProbeBatches.from_schedule(ok, ok, None, say=lambda *a, **k: None).size_fn is token_count
    with pytest.raises(RetuneError, match="sample_size is given twice"):
        ProbeBatches.from_schedule(ok, ok, len, say=lambda *a, **k: None)


# -- scanning, choosing, caching --------------------------------------------------------------------


def _data(lengths: list[int], **kwargs: Any) -> TokenDataset:
    return TokenDataset(lengths, **kwargs)


def test_scan_orders_largest_first_ties_by_index() -> None:
    data = _data([3, 9, 5, 9, 1])
    scan = scan_sizes(data, range(5), token_count)
    assert scan.order == [1, 3, 2, 0, 4]
    assert scan.sizes == [9, 9, 5, 3, 1]
    assert scan.largest(2) == [1, 3]
    assert scan.largest(9) == [1, 3, 2, 0, 4]


def test_scan_limit_reads_a_seeded_subset_and_fills_from_the_rest() -> None:
    data = _data([1] * 100)
    first = scan_sizes(data, range(100), token_count, limit=10)
    again = scan_sizes(data, range(100), token_count, limit=10)
    assert first.scanned == 10 and first.order == again.order
    assert data.reads == 20
    picked = first.largest(15)
    assert picked[:10] == first.order and len(set(picked)) == 15  # then unscanned samples, in dataset order


def test_scanning_leaves_every_rng_where_it_was() -> None:
    data = _data([4] * 50, augment=True)  # __getitem__ draws from torch's, Python's and NumPy's RNG
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    scan_sizes(data, range(50), token_count)
    size_spread(data, range(50), token_count)
    SizeCache().get(data, range(50), token_count, None)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]
    generator = torch.Generator().manual_seed(5)
    state = generator.get_state()
    with preserved_rng([generator]):
        torch.rand(2, generator=generator)
    assert torch.equal(generator.get_state(), state)


def test_spread_flags_widely_varying_sizes() -> None:
    assert size_spread(_data([10] * 60), range(60), token_count).ratio == 1.0
    assert not size_spread(_data([10] * 60), range(60), token_count).wide
    mixed = size_spread(_data([8, 40] * 30), range(60), token_count)
    assert mixed.largest == 40 and mixed.wide


def test_cache_scans_a_dataset_once_even_when_the_hook_rebuilds_it() -> None:
    cache = SizeCache()
    rows = [3, 9, 5] * 100
    data = _data(rows)
    scan, fresh = cache.get(data, range(300), token_count, None)
    assert fresh and cache.scans == 1
    assert cache.get(data, range(300), token_count, None) == (scan, False)
    rebuilt = _data(rows)  # what `DataLoader(MyDataset(self.rows))` in the hook gives at every call
    assert cache.get(rebuilt, range(300), token_count, None) == (scan, False)
    assert rebuilt.reads <= FINGERPRINT_SAMPLES + FINGERPRINT_LARGEST  # a fingerprint, not a scan
    changed = _data([3, 9, 50] * 100)
    assert cache.get(changed, range(300), token_count, None)[1] is True
    assert cache.get(data, range(300), len, None)[1] is True  # another size function: another scan
    assert cache.scans == 3


def test_the_same_object_changed_in_place_is_scanned_again() -> None:
    lengths = [random.Random(i).choice([8, 12, 200]) for i in range(400)]
    data = Curriculum(lengths, max_len=64)
    cache = SizeCache()
    scan, _ = cache.get(data, range(400), token_count, None)
    assert scan.sizes[0] == 64
    reads = data.reads
    assert cache.get(data, range(400), token_count, None) == (scan, False)  # unchanged: a fingerprint check
    assert data.reads - reads <= FINGERPRINT_SAMPLES + FINGERPRINT_LARGEST and cache.scans == 1
    data.max_len = 128  # the curriculum: only the long texts (the largest samples) change
    again, fresh = cache.get(data, range(400), token_count, None)
    assert fresh and again.sizes[0] == 128 and cache.scans == 2
    assert cache.get(data, range(400), token_count, None) == (again, False)
    assert len(cache.entries) == 1, "the stale scan of the same object is dropped"


def test_the_fingerprint_reads_strided_and_the_largest_samples_and_misses_the_rest() -> None:
    lengths = [8] * 400
    lengths[123] = 60
    data = _data(lengths)
    cache = SizeCache()
    cache.get(data, range(400), token_count, None)
    indices = fingerprint_indices(range(400), [123])
    assert indices[0] == 0 and indices[FINGERPRINT_SAMPLES - 1] == 399 and 123 in indices
    data.rows[123] = torch.ones(90, dtype=torch.long)  # the largest sample grew: seen
    assert cache.get(data, range(400), token_count, None)[1] is True
    read = cache.entries[0].fingerprint.indices
    unread = next(i for i in range(400) if i not in read)
    data.rows[unread] = torch.ones(300, dtype=torch.long)  # a sample it does not read: not seen (documented)
    assert cache.get(data, range(400), token_count, None)[1] is False


class _RandomCrop(TokenDataset):
    """A random crop whose length comes from the global RNG: sizes differ from read to read."""

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = super().__getitem__(index)
        keep = 1 + int(torch.randint(0, len(sample["input_ids"]), ()))
        return {**sample, "input_ids": sample["input_ids"][:keep]}


def test_a_random_size_augmentation_keeps_its_fingerprint_and_the_run_keeps_its_rng() -> None:
    data = _RandomCrop([40] * 200)
    cache = SizeCache()
    cache.get(data, range(200), token_count, None)
    state = torch.get_rng_state()
    for _ in range(3):
        torch.rand(5)  # the run draws between checks
        assert cache.get(data, range(200), token_count, None)[1] is False
    assert cache.scans == 1
    torch.rand(5)
    assert not torch.equal(state, torch.get_rng_state())
    before = torch.get_rng_state()
    cache.get(data, range(200), token_count, None)
    assert torch.equal(before, torch.get_rng_state())


def test_checking_once_reads_a_dataset_once_per_window() -> None:
    data = _data([3, 9, 5] * 100)
    cache = SizeCache()
    cache.get(data, range(300), token_count, None)
    with cache.checking_once():
        for _ in range(5):
            cache.get(data, range(300), token_count, None)
    assert cache.checks == 1
    cache.get(data, range(300), token_count, None)
    assert cache.checks == 2, "outside a window every look-up checks"


# -- the loader -------------------------------------------------------------------------------------


class _Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        return iter(range(10))


class _Buckets(BatchSampler):
    pass


def test_why_a_loader_cannot_be_reordered() -> None:
    data = _data([2] * 8)
    assert why_not_reorderable(DataLoader(data, batch_size=2)) is None
    explicit = DataLoader(data, batch_sampler=BatchSampler(SequentialSampler(data), 2, False))
    assert why_not_reorderable(explicit) is None
    assert "IterableDataset" in str(why_not_reorderable(DataLoader(_Stream(), batch_size=2)))
    bucketing = DataLoader(data, batch_sampler=_Buckets(SequentialSampler(data), 2, False))
    assert "batch_sampler (_Buckets) decides which samples go together" in str(why_not_reorderable(bucketing))
    assert "batch_size=None" in str(why_not_reorderable(DataLoader(data, batch_size=None)))
    assert "not a torch DataLoader" in str(why_not_reorderable([torch.zeros(2)]))


def test_candidates_follow_subset_and_weighted_samplers() -> None:
    assert candidate_indices(SequentialSampler(range(5)), 5) == range(5)
    assert candidate_indices(SubsetRandomSampler([4, 1]), 5) == [4, 1]
    weighted = torch.utils.data.WeightedRandomSampler([0.0, 1.0, 0.0, 2.0], 4)
    assert candidate_indices(weighted, 4) == [1, 3]


def test_the_copy_reads_the_chosen_indices_through_the_users_collate_and_leaves_the_loader_alone() -> None:
    data = _data([2, 7, 3, 7, 1, 4])
    loader = DataLoader(data, batch_size=2, shuffle=True, collate_fn=pad_collate, generator=torch.Generator())
    probe = with_index_order(loader, [1, 3, 1, 3], 2)
    batches = list(probe)
    assert len(probe) == 2 and len(batches) == 2
    assert batches[0][0].shape == (2, 7)  # padded by the user's collate_fn
    assert torch.equal(batches[0][0], batches[1][0])
    assert type(probe) is type(loader) and probe.collate_fn is pad_collate and probe.generator is loader.generator
    assert loader.batch_size == 2 and isinstance(loader.sampler, torch.utils.data.RandomSampler)
    assert len(list(loader)) == 3


def test_arrange_largest_gives_the_b_largest_for_every_step() -> None:
    data = _data([2, 7, 3, 8, 1, 4, 2, 2])
    batches = ProbeBatches("largest", token_count)
    loader = batches.arrange(DataLoader(data, batch_size=3, collate_fn=pad_collate), "train", steps=2)
    got = [ids for ids, _ in loader]
    assert len(got) == 2 and all(ids.shape == (3, 8) for ids in got)
    assert sorted(len(data.rows[i]) for i in loader.batch_sampler.sampler.indices[:3]) == [4, 7, 8]
    with batches.cache.checking_once():  # one search: its trials
        reads = data.reads
        batches.arrange(DataLoader(data, batch_size=5, collate_fn=pad_collate), "train", steps=2)
        batches.arrange(DataLoader(data, batch_size=5, collate_fn=pad_collate), "train", steps=2)
        assert data.reads - reads == 8  # the first trial checks the fingerprint (all 8 samples); the next reuse it
    assert batches.cache.scans == 1


def test_the_copy_keeps_the_users_workers_and_never_shares_a_persistent_pool() -> None:
    data = _data([2, 9, 3, 4])
    loader = DataLoader(data, batch_size=2, num_workers=1, persistent_workers=True, collate_fn=pad_collate)
    assert len(list(loader)) == 2
    pool = loader._iterator
    assert pool is not None  # the user's persistent workers
    probe = with_index_order(loader, [1, 3], 2)
    assert probe.num_workers == 1 and probe._iterator is None and not probe.persistent_workers
    ((ids, _),) = list(probe)  # read by a worker process, collated by the user's function
    assert ids.shape == (2, 9)
    assert loader._iterator is pool and loader.persistent_workers
