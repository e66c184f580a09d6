"""Pure splitting logic: every sample once, in order, containers rebuilt as they were."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import pytest
import torch

from retune.recovery.split import (
    Readings,
    SplitError,
    batch_length,
    join_outputs,
    piece_sizes,
    samples_as_listed,
    split_batch,
)


def test_piece_sizes_cover_every_sample_and_never_exceed_the_total() -> None:
    for total in range(1, 30):
        for pieces in range(1, 40):
            sizes = piece_sizes(total, pieces)
            assert sum(sizes) == total and len(sizes) == min(pieces, total) and max(sizes) - min(sizes) <= 1


def test_nested_containers_split_and_rebuild() -> None:
    Pair = namedtuple("Pair", "x y")

    @dataclass
    class Item:
        ids: torch.Tensor
        names: list[str]

    batch = {
        "pair": Pair(torch.arange(5), torch.arange(5) * 2),
        "item": Item(torch.arange(10).view(5, 2), ["a", "b", "c", "d", "e"]),
        "scale": torch.tensor(3.0),
        "task": "nli",
        "od": OrderedDict(m=torch.ones(5, 1)),
    }
    parts = split_batch(batch, 2)
    assert [batch_length(p) for p in parts] == [3, 2]
    assert isinstance(parts[0]["pair"], Pair) and isinstance(parts[0]["od"], OrderedDict)
    assert parts[1]["item"].names == ["d", "e"] and parts[1]["task"] == "nli"
    assert torch.equal(torch.cat([p["pair"].y for p in parts]), batch["pair"].y)
    assert parts[0]["scale"] is batch["scale"]


def test_more_pieces_than_samples_gives_single_samples() -> None:
    parts = split_batch((torch.zeros(3, 2), torch.arange(3)), 8)
    assert len(parts) == 3 and all(batch_length(p) == 1 for p in parts)


def test_unknown_type_and_ambiguous_batches_are_clear_errors() -> None:
    class Opaque:
        pass

    with pytest.raises(SplitError, match=r"cannot split a batch of type .*Opaque.*split_batch=fn"):
        split_batch(Opaque(), 2)
    names = r"disagree on their first dimension \(\[3, 4\]: batch\[1\] has 4, batch\[0\] has 3\)"
    with pytest.raises(SplitError, match=names):
        split_batch((torch.zeros(3), torch.zeros(4)), 2)
    with pytest.raises(SplitError, match="no tensor with a batch dimension"):
        split_batch({"a": 1}, 2)


def test_custom_split_function_is_used_and_checked() -> None:
    assert split_batch([1, 2, 3, 4], 2, lambda b, n: [b[:2], b[2:]]) == [[1, 2], [3, 4]]
    with pytest.raises(SplitError, match="no micro-batches"):
        split_batch([1], 2, lambda b, n: [])


def test_join_outputs_concatenates_batch_dimensions_and_keeps_scalars() -> None:
    outs = [
        {"logits": torch.ones(2, 3), "loss": torch.tensor(1.0), "ids": ["a", "b"]},
        {"logits": torch.zeros(1, 3), "loss": torch.tensor(2.0), "ids": ["c"]},
    ]
    joined = join_outputs(outs)
    assert joined["logits"].shape == (3, 3) and joined["loss"].item() == 2.0 and joined["ids"] == ["a", "b", "c"]
    assert join_outputs([None, None]) is None


def test_join_outputs_concatenates_a_list_of_one_tensor_per_sample() -> None:
    """``list(logits.unbind(0))`` or generated sequences of their own lengths: as long as the micro-batch, so per
    sample, and concatenated. Joined position by position (as ``(logits, x)`` is), it kept the last micro-batch's
    four tensors of eight."""
    logits = torch.randn(8, 3)
    parts = [list(logits[:4].unbind(0)), list(logits[4:].unbind(0))]
    joined = join_outputs(parts, [4, 4])
    assert len(joined) == 8 and all(torch.equal(a, b) for a, b in zip(joined, logits.unbind(0), strict=True))
    ragged = [[torch.ones(n) for n in (5, 6, 4, 9)], [torch.ones(n) for n in (7, 2, 3, 1)]]
    assert [len(t) for t in join_outputs(ragged, [4, 4])] == [5, 6, 4, 9, 7, 2, 3, 1]
    # a pair of batches as long as the micro-batch is still joined position by position
    pairs = [(torch.zeros(2, 3), torch.zeros(2)), (torch.ones(2, 3), torch.ones(2))]
    assert [tuple(t.shape) for t in join_outputs(pairs, [2, 2])] == [(4, 3), (4,)]


def test_hugging_face_batch_encoding_splits_into_batch_encodings() -> None:
    transformers = pytest.importorskip("transformers")
    batch = transformers.BatchEncoding(
        {"input_ids": torch.arange(12).view(4, 3), "attention_mask": torch.ones(4, 3), "labels": torch.arange(4)}
    )
    parts = split_batch(batch, 2)
    assert all(isinstance(p, transformers.BatchEncoding) for p in parts)
    assert [p["labels"].tolist() for p in parts] == [[0, 1], [2, 3]]
    assert parts[1].input_ids.shape == (2, 3)  # attribute access still works
    assert torch.equal(join_outputs([{"logits": p["input_ids"]} for p in parts])["logits"], batch["input_ids"])


def test_a_zip_collate_is_refused_not_cut_along_the_channels() -> None:
    images = tuple(torch.zeros(3, 8, 8) for _ in range(4))
    with pytest.raises(SplitError, match=r"no tensor with a batch dimension .*zip"):
        split_batch((images, (0, 1, 2, 3)), 2)
    with pytest.raises(SplitError, match=r"3 rows and lists of \[4\] per-sample values"):
        split_batch((torch.zeros(3, 2), ["a", "b", "c", "d"]), 2)


def test_join_keeps_per_batch_statistics_and_ragged_predictions_whole() -> None:
    outs = [{"stat": torch.ones(4), "pred": torch.zeros(2, 5)}, {"stat": torch.ones(4) * 2, "pred": torch.zeros(2, 7)}]
    joined = join_outputs(outs, sizes=[2, 2])
    assert torch.equal(joined["stat"], torch.ones(4) * 2)  # not batched: the last micro-batch's
    assert [p.shape for p in joined["pred"]] == [(2, 5), (2, 7)]  # batched, ragged: every piece, in order


def test_a_list_of_samples_as_the_dataset_returns_them_splits_into_samples() -> None:
    """``collate_fn=lambda b: b``: a list of ``(image, label)`` samples of one shape was read as a batch of
    ``image.shape[0]`` (3, the channels) and split along each sample's channels, every micro-batch holding every
    sample; the samples are the batch where the run's first batch held as many as the loader was asked for."""
    samples = [(torch.full((3, 4, 4), float(i)), i) for i in range(5)]
    readings = Readings()
    readings.note_first(samples, 5)
    assert readings.listed and batch_length(samples, readings) == 5
    pieces = split_batch(samples, 2, readings=readings)
    assert [len(p) for p in pieces] == [3, 2] and all(isinstance(p, list) for p in pieces)
    assert [label for p in pieces for _, label in p] == [0, 1, 2, 3, 4]
    assert all(image.shape == (3, 4, 4) for p in pieces for image, _ in p)
    assert [len(p) for p in split_batch(samples[:3], 3, readings=readings)] == [1, 1, 1]  # a shorter last batch
    records = [{"input_ids": torch.ones(7, dtype=torch.long), "labels": torch.ones(7)} for i in range(4)]
    fixed_length = Readings()
    fixed_length.note_first(records, 4)  # every field a tensor of one length: 7 rows where 4 were asked for
    assert [len(p) for p in split_batch(records, 4, readings=fixed_length)] == [1, 1, 1, 1]


def test_lists_that_are_batches_are_not_read_as_samples() -> None:
    """What a collate makes stays a batch: ``[x, y]`` (default_collate of tuples), a ``tuple(zip(*samples))`` of
    images and labels (also of two samples, two fields), per-sample strings of a text pair, one batch per loader
    (``CombinedLoader``'s list, each with a count or a task name: a review found those read as two samples)."""
    x, y = torch.zeros(6, 3), torch.zeros(6, dtype=torch.long)
    assert not samples_as_listed([x, y], 6) and batch_length([x, y]) == 6
    zipped = (tuple(torch.zeros(3, 8, 8) for _ in range(2)), (1, 0))
    assert not samples_as_listed(zipped, 2) and not samples_as_listed((zipped[0] * 2, (1, 0, 1, 0)), 4)
    assert not samples_as_listed([["a", "b", "c"], ["d", "e", "f"]], 3)
    assert not samples_as_listed([[x, y, "task_a"], [x, y, "task_b"]], 6)
    loaders = [{"x": x, "y": y, "n_tokens": 12}, {"x": x, "y": y, "n_tokens": 9}]
    readings = Readings()
    readings.note_first(loaders, 6)
    assert not readings.listed and batch_length(loaders, readings) == 6
    assert [[len(b["y"]) for b in p] for p in split_batch(loaders, 2, readings=readings)] == [[3, 3], [3, 3]]
    two = [{"x": x[:2], "y": y[:2], "task": "a"}, {"x": x[:2], "y": y[:2], "task": "b"}]
    assert not samples_as_listed(two, 2)  # two loaders' batches of 2 where 2 were asked for: read as batches


def test_a_batch_that_reads_both_ways_is_split_as_the_run_read_its_first_batch() -> None:
    """Three tensors of three rows read as three samples' tensors or as three batches: an ``(ids, mask, type_ids)``
    triple of 8 rows reads as batches, so its last batch of 3 must too (it was split as one tensor per sample, and
    ``training_step`` could not unpack two tensors); two stereo clips of 2 channels beside 8 clips read as samples."""
    readings = Readings()
    full = (tuple(torch.zeros(8, 5) for _ in range(3)), torch.arange(8))
    assert batch_length(full, readings) == 8 and readings.per_sample == {"batch[0]": False}
    last = (tuple(torch.arange(15.0).view(3, 5) + 100 * j for j in range(3)), torch.arange(3))
    pieces = split_batch(last, 2, readings=readings)
    assert [[tuple(t.shape) for t in p[0]] for p in pieces] == [[(2, 5)] * 3, [(1, 5)] * 3]
    assert [p[1].tolist() for p in pieces] == [[0, 1], [2]]
    stereo = Readings()
    batch_length({"clips": [torch.zeros(2, 100)] * 8, "ids": torch.zeros(8, 4)}, stereo)
    last_two = {"clips": [torch.full((2, 100), float(i)) for i in range(2)], "ids": torch.arange(8.0).view(2, 4)}
    halves = split_batch(last_two, 2, readings=stereo)
    assert [len(h["clips"]) for h in halves] == [1, 1] and [h["clips"][0][0, 0].item() for h in halves] == [0.0, 1.0]
    assert [h["clips"][0].shape for h in halves] == [(2, 100), (2, 100)]
