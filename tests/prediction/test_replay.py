"""A recorded trace replayed at another batch (``retune.prediction.replay``): equal to a trace there, or refused.

The claim is exact: a replay is the recording's storages with their batch dimensions scaled, and its phases
accounted by the trace's own code, so on a step whose storages scale with the batch's dimensions it equals
a trace at the target to the byte, in every field a prediction reads. The scenarios are the prediction
models (MLP with BatchNorm and Dropout, CNN, BERT with an attention mask, GPT-2 + LoRA with a shifted
language-model loss: ``length - 1``), each with the optimizer state still to be created (the trace measures
the update) and existing, at other sizes and, for the sequence models, other lengths. Where the sizes cannot
be told apart a replay refuses; where a step's storages do not scale this way (padding to a multiple inside
the step) a replay is wrong, and the first predicted search of a fit finds that out and keeps tracing.
No OOM is involved (no oracle): every number is a trace's count.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from retune.prediction.replay import (
    Scaling,
    activation_sizes,
    model_sizes,
    replay,
    scaling,
    tag_size,
    target_shapes,
)
from retune.prediction.trace import CannotPredict, StepTrace, fixed_dims, trace_step
from tests.helpers.prediction_models import SCENARIOS, PredictionModel

FIELDS = (
    "peak_bytes",
    "steady_bytes",
    "steady_parts",
    "compute_bytes",
    "update_start_bytes",
    "forward_bytes",
    "backward_bytes",
    "update_bytes",
    "batch_bytes",
    "created_bytes",
    "resident_bytes",
    "grads_before",
    "grads_after",
    "optimizer",
)


def _step(model: PredictionModel) -> Any:
    def step(batch: Any, optimizers: list[torch.optim.Optimizer]) -> None:
        optimizer = optimizers[0]

        def closure() -> torch.Tensor:
            loss = model.loss_of(model.net, batch)
            optimizer.zero_grad()
            loss.backward()
            return loss

        optimizer.step(closure)

    return step


def _model(name: str, length: int | None) -> PredictionModel:
    if name in ("bert", "gpt2_lora"):
        pytest.importorskip("transformers")
        if name == "gpt2_lora":
            pytest.importorskip("peft")
        return SCENARIOS[name](seq=length or 61)  # type: ignore[call-arg]
    return SCENARIOS[name]()


TARGETS = {
    "mlp": [(4, None), (512, None)],
    "cnn": [(1, None), (200, None)],
    "bert": [(200, 30), (3, 127), (13, 61), (1, 100)],
    "gpt2_lora": [(200, 30), (5, 127), (17, 64)],
}


@pytest.mark.parametrize("state", ["fresh", "steady"])
@pytest.mark.parametrize("name", sorted(TARGETS))
def test_a_replay_equals_a_trace_at_the_target_in_every_field(name: str, state: str) -> None:
    torch.manual_seed(0)
    model = _model(name, 61)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    step = _step(model)
    if state == "steady":  # the state exists: the trace reuses nothing, the update runs on it
        step(model.make_batch(2), [optimizer])
    batch = model.make_batch(2)
    tag = tag_size(batch, fixed_dims(model))
    assert tag is not None
    source = trace_step(model, [optimizer], batch, tag, step, steps=1, record=True)
    assert isinstance(source, StepTrace) and source.recording is not None
    for size, length in TARGETS[name]:
        target = _model(name, length).make_batch(2) if length else batch
        replayed = replay(source, target_shapes(target, size), size)
        traced = trace_step(model, [optimizer], target, size, step, steps=1)
        assert isinstance(replayed, StepTrace) and isinstance(traced, StepTrace), (replayed, traced)
        for field in FIELDS:
            assert getattr(replayed, field) == getattr(traced, field), (size, length, field)
        assert replayed.size == size and replayed.seconds < traced.seconds


def test_a_recording_is_kept_only_when_asked_and_a_trace_without_one_cannot_be_replayed() -> None:
    net = nn.Linear(64, 32)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(batch: Any, optimizers: list[torch.optim.Optimizer]) -> None:
        net(batch).sum().backward()
        optimizers[0].step()

    plain = trace_step(net, [optimizer], torch.ones(2, 64), 13, step, steps=1)
    assert isinstance(plain, StepTrace) and plain.recording is None
    refused = replay(plain, target_shapes(torch.ones(2, 64), 100), 100)
    assert isinstance(refused, CannotPredict) and "no recording" in refused.reason
    recorded = trace_step(net, [optimizer], torch.ones(2, 64), 13, step, steps=1, record=True)
    assert isinstance(recorded, StepTrace) and recorded.recording is not None
    # the recording is not part of equality: the same trace with and without it compare equal
    assert dataclasses.replace(recorded, seconds=0.0) == dataclasses.replace(plain, seconds=0.0)
    for size in (0, -3):
        refused = replay(recorded, target_shapes(torch.ones(2, 64), 4), size)
        assert isinstance(refused, CannotPredict) and "at least one sample" in refused.reason
    odd = replay(recorded, None, 4)  # type: ignore[arg-type]
    assert isinstance(odd, CannotPredict)  # never raises


class ShiftedLM(nn.Module):
    """A language model whose loss drops the last position (``length - 1``), as Hugging Face's causal LMs do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 1000)

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.mid(self.embed(ids)).relu())[:, :-1]
        return F.cross_entropy(logits.reshape(-1, 1000), ids[:, 1:].reshape(-1))


def _lm_trace(net: ShiftedLM, length: int, size: int, record: bool = False) -> Any:
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)

    def step(batch: Any, optimizers: list[torch.optim.Optimizer]) -> None:
        net.loss(batch).backward()
        optimizers[0].step()

    return trace_step(net, [optimizer], torch.zeros(2, length, dtype=torch.long), size, step, steps=1, record=record)


def test_a_shifted_length_that_is_also_a_model_size_is_refused_not_misread() -> None:
    """41 tokens: the loss's 40 positions divide the vocabulary of 1000, so a dimension of 40 could be the model's
    or the length's: the replay refuses (it read 40 as the model's and was 39% low at 100 tokens). 61 tokens
    (60 divides nothing) replays exactly."""
    net = ShiftedLM()
    target = target_shapes(torch.zeros(2, 100, dtype=torch.long), 50)
    unsure = _lm_trace(net, 41, tag_size(torch.zeros(2, 41), fixed_dims(net)) or 0, record=True)
    refused = replay(unsure, target, 50)
    assert isinstance(refused, CannotPredict) and "40" in refused.reason, refused
    sure = _lm_trace(net, 61, tag_size(torch.zeros(2, 61), fixed_dims(net)) or 0, record=True)
    replayed, traced = replay(sure, target, 50), _lm_trace(net, 100, 50)
    assert isinstance(replayed, StepTrace) and replayed.peak_bytes == traced.peak_bytes


class Doubled(nn.Module):
    """Token embeddings of 32 concatenated with themselves: a width of 64 that no parameter has (the blind spot of
    one recording: at 63 tokens it reads as ``length + 1``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.mid = nn.Linear(32, 32)

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.embed(ids))
        return torch.cat([h, h], -1).relu().pow(2).mean()


def _doubled_trace(net: Doubled, length: int, size: int, record: bool = False) -> Any:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(batch: Any, optimizers: list[torch.optim.Optimizer]) -> None:
        net.loss(batch).backward()
        optimizers[0].step()

    return trace_step(net, [optimizer], torch.zeros(2, length, dtype=torch.long), size, step, steps=1, record=record)


def test_an_activation_size_next_to_a_later_length_is_known_from_an_earlier_recording() -> None:
    """One recording at 63 tokens cannot tell the width of 64 from ``length + 1``: replayed at 100 tokens it is
    wrong. A recording at 20 tokens shows 64 as the model's own (:func:`activation_sizes`); given it, the replay
    from 63 refuses (the caller traces), and the tag size avoids primes that divide it."""
    net = Doubled()
    earlier = _doubled_trace(net, 20, tag_size(torch.zeros(2, 20), fixed_dims(net)) or 0, record=True)
    seen = activation_sizes(earlier)
    assert 64 in seen and not seen & {20, 21, 22, 18, 19, 32, 50}
    tag = tag_size(torch.zeros(2, 63), fixed_dims(net), seen=seen)
    assert tag is not None and 64 % tag != 0
    later = _doubled_trace(net, 63, tag, record=True)
    target = target_shapes(torch.zeros(2, 100, dtype=torch.long), 40)
    blind, traced = replay(later, target, 40), _doubled_trace(net, 100, 40)
    assert isinstance(blind, StepTrace) and blind.peak_bytes != traced.peak_bytes  # 64 read as 63 + 1: 101
    refused = replay(later, target, 40, seen=seen)
    assert isinstance(refused, CannotPredict) and "64" in refused.reason, refused
    # the earlier recording itself replays exactly: 64 is not next to 20
    exact = replay(earlier, target, 40, seen=seen)
    assert isinstance(exact, StepTrace) and exact.peak_bytes == traced.peak_bytes
    assert tag_size(torch.zeros(2, 64), fixed_dims(net), seen=seen) is None  # 64 tokens: the model's size too


class Clipped(nn.Module):
    """Token embeddings through ten linear layers: 21 parameter tensors, whose gradients ``clip_grad_norm_``
    stacks into one storage of 21 norms (a size that nothing but the parameters' count explains)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(10))

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h).relu()
        return h.pow(2).mean()


def _clipped_trace(net: Clipped, length: int, size: int, record: bool = False) -> Any:
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(batch: Any, optimizers: list[torch.optim.Optimizer]) -> None:
        net.loss(batch).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizers[0].step()

    return trace_step(net, [optimizer], torch.zeros(2, length, dtype=torch.long), size, step, steps=1, record=record)


def test_an_ambiguous_size_of_a_few_bytes_is_read_both_ways_and_replays() -> None:
    """Clipping's 21 norms are an activation size (from a recording at 40 tokens); at 20 tokens they are also
    ``length + 1``. Read both ways the prediction moves by a few bytes, so the replay stands, equal to a trace at
    the target; a width the step computes with (``Doubled``'s 64, above) still refuses."""
    net = Clipped()
    seen = activation_sizes(_clipped_trace(net, 40, tag_size(torch.zeros(2, 40), fixed_dims(net)) or 0, True))
    assert seen == {21}
    tag = tag_size(torch.zeros(2, 20), fixed_dims(net), seen=seen)
    assert tag is not None
    source = _clipped_trace(net, 20, tag, record=True)
    target = target_shapes(torch.zeros(2, 50, dtype=torch.long), 30)
    assert isinstance(source, StepTrace) and source.recording is not None
    replayed = replay(source, target, 30, seen=seen)
    traced = _clipped_trace(net, 50, 30)
    assert isinstance(replayed, StepTrace), replayed
    assert (replayed.peak_bytes, replayed.steady_bytes) == (traced.peak_bytes, traced.steady_bytes)


def test_the_tag_size_divides_no_size_next_to_a_sample_size() -> None:
    """53 tokens: 52 positions are 4 x 13, so a trace at 13 samples would read the loss's positions as 4 batches
    (+99% to +296% where it did); the tag moves past 13 and 17 (51 = 3 x 17) and the replay is exact."""
    net = ShiftedLM()
    tag = tag_size(torch.zeros(2, 53), fixed_dims(net))
    assert tag == 19
    source = _lm_trace(net, 53, tag, record=True)
    for length, size in ((100, 50), (53, 7)):
        replayed = replay(source, target_shapes(torch.zeros(2, length, dtype=torch.long), size), size)
        assert isinstance(replayed, StepTrace) and replayed.peak_bytes == _lm_trace(net, length, size).peak_bytes


def test_a_sample_size_the_target_keeps_is_not_moved_with_a_neighbouring_length() -> None:
    """Tokens of 23 that change and features of 24 that do not: 24 is not read as ``length + 1``."""
    embed, proj = nn.Embedding(100, 8), nn.Linear(4, 8)
    params = [*embed.parameters(), *proj.parameters()]
    net = nn.ModuleList([embed, proj])
    optimizer = torch.optim.SGD(params, lr=0.1)

    def step(batch: Any, optimizers: list[torch.optim.Optimizer]) -> None:
        ids, features = batch
        (embed(ids).sum() + proj(features).sum()).backward()
        optimizers[0].step()

    def batch(length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(2, length, dtype=torch.long), torch.ones(2, 24, 4)

    source = trace_step(net, [optimizer], batch(23), 13, step, steps=1, record=True)
    replayed = replay(source, target_shapes(batch(40), 30), 30)
    traced = trace_step(net, [optimizer], batch(40), 30, step, steps=1)
    assert isinstance(replayed, StepTrace) and isinstance(traced, StepTrace)
    assert (replayed.peak_bytes, replayed.batch_bytes) == (traced.peak_bytes, traced.batch_bytes)


def test_a_recording_that_reused_the_update_replays_as_a_trace_that_reuses_it() -> None:
    """The later traces of a search reuse the first one's update (``optimizer=``): their recordings replay too."""
    torch.manual_seed(0)
    model = _model("mlp", None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = _step(model)
    batch = model.make_batch(2)
    first = trace_step(model, [optimizer], batch, 64, step, steps=1)
    assert isinstance(first, StepTrace) and first.optimizer is not None
    source = trace_step(model, [optimizer], batch, 13, step, steps=1, optimizer=first.optimizer, record=True)
    assert isinstance(source, StepTrace) and source.recording is not None and source.recording.reuse is not None
    replayed = replay(source, target_shapes(batch, 300), 300)
    traced = trace_step(model, [optimizer], batch, 300, step, steps=1, optimizer=first.optimizer)
    assert isinstance(replayed, StepTrace) and isinstance(traced, StepTrace)
    for field in FIELDS:
        assert getattr(replayed, field) == getattr(traced, field), field


@pytest.mark.parametrize(
    ("traced", "target", "size", "fixed", "says"),
    [
        ((((16, 64), 4096),), ((100, 64),), 16, frozenset({64, 32}), "divides a dimension"),
        ((((13, 64), 3328),), ((100, 30),), 13, frozenset({64}), "a size the model's own dimensions may take"),
        ((((13, 32), 1664),), ((100, 30),), 13, frozenset({64}), "a size the model's own dimensions may take"),
        ((((13, 61), 3172), ((13, 61), 3172)), ((100, 30), (100, 40)), 13, frozenset(), "becomes both"),
        ((((13, 26), 1352),), ((100, 30),), 13, frozenset(), "multiple of the traced batch size"),
        ((((13, 61), 3172),), ((100, 30), (100,)), 13, frozenset(), "other tensors"),
        ((((1, 61), 244),), ((100, 30),), 1, frozenset(), "cannot tell the batch dimension"),
    ],
)
def test_a_replay_refuses_where_the_sizes_cannot_be_told_apart(
    traced: Any, target: Any, size: int, fixed: frozenset[int], says: str
) -> None:
    reason = scaling(traced, target, size, 100, fixed)
    assert isinstance(reason, str) and says in reason, reason


def test_the_scaling_reads_flattened_batches_heads_and_shifted_lengths() -> None:
    scale = Scaling(13, 100, {61: 30}, model_sizes({64, 128}))
    assert scale.dim(13) == 100 and scale.dim(61) == 30
    assert scale.dim(13 * 61) == 3000  # batch x length, flattened
    assert scale.dim(13 * 2) == 200  # batch x heads
    assert scale.dim(60) == 29 and scale.dim(62) == 31  # a shifted target, a prepended token
    assert scale.dim(64) == 64 and scale.dim(128) == 128  # the model's own
    assert scale.bytes(13 * 61 * 64 * 4, (13, 61, 64)) == 100 * 30 * 64 * 4
    near_a_head = Scaling(13, 100, {65: 30}, model_sizes({128}))  # 64 is a head's size, not the length - 1
    assert near_a_head.dim(64) == 64 and near_a_head.dim(66) == 31


def test_no_tag_size_where_a_sample_size_may_be_the_models_own() -> None:
    """64 tokens, hidden 128 in two heads of 64: attention's ``(batch, heads, tokens, 64)`` and its scores
    ``(batch, heads, tokens, tokens)`` look alike, so nothing is recorded (the search traces instead)."""
    assert tag_size(torch.ones(2, 64), {128, 30}) is None
    assert tag_size(torch.ones(2, 61), {128, 30}) == 13
    assert tag_size(torch.ones(2, 3, 32, 32), {16, 3, 10}) == 13  # channels are a parameter's dimension


class PaddedToMultiple(nn.Module):
    """Pads the sequence to a multiple of 32 inside the step: its activations' length is not the batch's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.out = nn.Linear(16, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = F.pad(ids, (0, (-ids.shape[1]) % 32))
        return self.out(self.embed(ids).relu()).mean(1)


def test_a_step_whose_storages_do_not_scale_with_the_batch_replays_wrong() -> None:
    """Why a fit checks replays against traces before it trusts them (``retune.buckets.batching``)."""
    net = PaddedToMultiple()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)

    def step(batch: Any, optimizers: list[torch.optim.Optimizer]) -> None:
        net(batch).sum().backward()
        optimizers[0].step()

    source = trace_step(net, [optimizer], torch.ones(2, 61, dtype=torch.long), 13, step, steps=1, record=True)
    target = torch.ones(2, 70, dtype=torch.long)
    replayed = replay(source, target_shapes(target, 50), 50)  # type: ignore[arg-type]
    traced = trace_step(net, [optimizer], target, 50, step, steps=1)
    assert isinstance(replayed, StepTrace) and isinstance(traced, StepTrace)
    assert not math.isclose(replayed.peak_bytes, traced.peak_bytes, rel_tol=0.01)


def test_a_replay_check_compares_every_phase_above_the_fixed_memory_not_only_the_peak() -> None:
    """Found by review: with one long outlier the longest bucket's cap is 1 sample, where the step peaks in the
    optimizer update, the same in a replay and a trace. A model that prepends 8 learned tokens replays its
    activations 7-85% wrong, and the check at that cap passed on the peak (8,781,844 bytes both): the fit replayed
    the middle bucket 42% low and a probe measured 1.69 times the budget. The check compares each phase's part
    above the memory no batch changes too."""
    from retune.search.predict_run import replay_matches

    fixed = 5_903_248.0
    traced_parts = (6_100_000.0, 6_250_000.0, 8_781_844.0)  # forward, backward: activations; the update peaks
    wrong = (6_040_000.0, 6_150_000.0, 8_781_844.0)  # the activations read 30-40% low, the same update
    assert replay_matches(8_781_844.0, 8_781_844.0)  # the peak alone: no difference to see
    assert not replay_matches(8_781_844.0, 8_781_844.0, wrong, traced_parts, fixed)
    assert replay_matches(8_781_844.0, 8_781_844.0, traced_parts, traced_parts, fixed)  # exact: to the byte
    assert not replay_matches(9_000_000.0, 8_781_844.0, traced_parts, traced_parts, fixed)  # the peak still counts
