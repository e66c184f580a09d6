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

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from retune.prediction.replay import Scaling, model_sizes, replay, scaling, tag_size, target_shapes
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
    assert recorded == plain or recorded.peak_bytes == plain.peak_bytes  # the recording is not part of equality


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
