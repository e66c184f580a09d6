"""The ``oom`` trigger on the losses, outputs and layers real fine-tunes use (issue 21).

Every recovered run is compared with the same run at unlimited capacity (the run with memory for every
batch): weights within 1e-5, the same global step, the same step-level and epoch-level logged loss,
the same learning rates from a ``ReduceLROnPlateau`` on ``train_loss_step``, step outputs with every
row of the batch, every sample trained once. The OOMs are the real ``torch.OutOfMemoryError``, raised
by oracles (tests/helpers/token_tasks.py, tests/helpers/oom_oracle.py) above a token or sample capacity.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import RetuneError, ScheduledBatchSizeFinder
from retune.messages import RetuneWarning
from retune.recovery.split import SplitError
from tests.helpers.lightning_ns import pl, seed
from tests.helpers.oom_oracle import TokenModel, pad_collate
from tests.helpers.token_tasks import TokenTask

HAS_HF = importlib.util.find_spec("transformers") is not None
TASKS = [
    pytest.param("torch", "labels", id="torch-tagger"),
    pytest.param("torch", "tests.helpers.token_tasks.labelled_tokens", id="torch-tagger-own-count"),
    pytest.param("token", "labels", id="hf-token-classification", marks=pytest.mark.skipif(not HAS_HF, reason="hf")),
    pytest.param("mlm", "labels", id="hf-masked-lm", marks=pytest.mark.skipif(not HAS_HF, reason="hf")),
    pytest.param("causal", "shifted_labels", id="hf-causal-lm", marks=pytest.mark.skipif(not HAS_HF, reason="hf")),
]


def _trainer(finder: Any = None, **kwargs: Any) -> Any:
    return pl.Trainer(
        max_epochs=kwargs.pop("max_epochs", 2),
        callbacks=[] if finder is None else [finder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **kwargs,
    )


def _fit_task(task: str, capacity: int | None, trigger: dict[str, Any] | None, where: str = "forward") -> Any:
    seed(0)
    model = TokenTask(task, capacity=capacity, where=where)
    finder = None
    if trigger is not None:
        finder = ScheduledBatchSizeFinder({"triggers": [trigger]}, verbose=False, write_report=False)
    trainer = _trainer(finder, max_epochs=1)
    trainer.fit(model)
    return model, finder, trainer


def _without_key_bias(name: str, p: torch.Tensor) -> torch.Tensor:
    """An attention layer's key bias has a gradient of exactly 0 in exact arithmetic (softmax ignores a constant
    per query); what it gets is rounding noise, which AdamW turns into full-size steps in any two runs that
    round differently, micro-batches or not. It is left out of the comparison (BERT's ``key.bias``, the middle
    third of GPT-2's fused ``c_attn.bias``)."""
    if name.endswith("attention.self.key.bias"):
        return p[:0]
    if name.endswith("attn.c_attn.bias"):
        third = p.shape[0] // 3
        return torch.cat([p[:third], p[2 * third :]])
    return p


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    pairs = zip(a.named_parameters(), b.named_parameters(), strict=True)
    diffs = [(_without_key_bias(name, x) - _without_key_bias(name, y)).abs() for (name, x), (_, y) in pairs]
    return max(d.max().item() for d in diffs if d.numel())


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize(("task", "items"), TASKS)
def test_token_mean_recovery_equals_the_run_with_memory(task: str, items: str, where: str) -> None:
    base, _, base_trainer = _fit_task(task, None, None)
    trigger = {"kind": "oom", "loss_reduction": "token_mean", "loss_items": items}
    model, finder, trainer = _fit_task(task, 50, trigger, where)
    recoveries = [e for e in finder.history if e.is_recovery]
    assert recoveries and all(e.micro_batches >= 2 for e in recoveries)
    assert trainer.global_step == base_trainer.global_step
    assert _max_diff(base, model) < 1e-5
    # what callbacks and monitors saw: the whole batch's outputs, its step-level loss, the same LR decisions
    assert all(rows == size for rows, size in model.output_rows)
    assert model.step_losses == pytest.approx(base.step_losses, abs=1e-5)
    assert model.lrs == base.lrs
    assert task != "torch" or len(set(base.lrs)) > 1  # there the plateau scheduler does lower the rate mid-epoch
    epoch_loss = trainer.callback_metrics["train_loss_epoch"]
    assert epoch_loss.item() == pytest.approx(base_trainer.callback_metrics["train_loss_epoch"].item(), abs=1e-5)
    if where == "forward":
        assert set(model.trained.values()) == {1} and len(model.trained) == len(model.samples)


def test_a_sample_mean_weighting_of_a_token_mean_loss_is_not_exact_and_is_warned_about() -> None:
    """The control: weighting by samples differs from the run with memory, and retune says why at fit start."""
    base, _, _ = _fit_task("torch", None, None)
    with pytest.warns(RetuneWarning, match=r"labels.*per token.*loss_reduction: token_mean"):
        model, _, _ = _fit_task("torch", 50, {"kind": "oom", "check_exactness": False})  # deliberately inexact
    assert _max_diff(base, model) > 1e-4


def test_token_mean_needs_labels_or_a_function_and_checks_at_fit_start() -> None:
    seed(0)
    model = TokenModel(capacity=None)  # its batches' labels are one class per sequence, under `labels`
    finder = ScheduledBatchSizeFinder(
        {"triggers": [{"kind": "oom", "loss_reduction": "token_mean"}]}, verbose=False, loss_items=lambda b: 1.5
    )
    trainer = _trainer(finder, max_epochs=1)
    with pytest.raises(RetuneError, match=r"loss_items .* returned 1.5 .* must return an int"):
        trainer.fit(model)
    assert trainer.global_step == 0

    class Tuples(TokenModel):
        def train_dataloader(self) -> Any:
            return DataLoader(self.data, batch_size=16, collate_fn=lambda s: tuple(pad_collate(s).values()))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            keys = ("input_ids", "attention_mask", "labels", "index")
            return super().training_step(dict(zip(keys, batch, strict=True)), batch_idx)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            pass

    finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "oom", "loss_reduction": "token_mean"}]}, verbose=False)
    with pytest.raises(RetuneError, match=r"`labels` key of a dict/BatchEncoding batch.*loss_items"):
        _trainer(finder, max_epochs=1).fit(Tuples())


def test_a_batch_with_no_counted_items_does_not_divide_by_zero() -> None:
    from retune.recovery.micro_batches import loss_weights as _weights

    pieces = [{"labels": torch.full((2, 3), -100)}, {"labels": torch.full((1, 3), -100)}]
    assert _weights(pieces, "token_mean") == [0.0, 0.0]
    pieces[1]["labels"][0, 0] = 1
    assert _weights(pieces, "token_mean") == [0.0, 1.0]
    assert _weights(pieces, "token_mean", items_fn=lambda b: len(b["labels"])) == pytest.approx([2 / 3, 1 / 3])


def test_loss_items_path_errors_name_the_field() -> None:
    from retune.errors import ScheduleError

    schedule = {"triggers": [{"kind": "epoch", "at": [1]}, {"kind": "oom", "loss_items": "no_such_mod.fn"}]}
    with pytest.raises(ScheduleError, match=r"triggers\[1\]\.loss_items: cannot import module 'no_such_mod'"):
        ScheduledBatchSizeFinder(schedule, verbose=False)


# -- BatchNorm ---------------------------------------------------------------------------------


class BatchNormNet(pl.LightningModule):  # type: ignore[misc,name-defined]
    """An MLP with BatchNorm1d; the oracle runs out of memory *after* the BatchNorm layer updated its statistics."""

    def __init__(self, capacity: int | None, n: int = 19, batch_size: int = 8) -> None:
        super().__init__()
        self.capacity = capacity
        self.batch_size = batch_size
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 12), nn.BatchNorm1d(12), nn.ReLU())
        self.head = nn.Linear(12, 3)
        self.micro_batches = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        hidden = self.body(x)  # BatchNorm's running statistics are updated here
        if self.capacity is not None and x.shape[0] > self.capacity:
            raise torch.OutOfMemoryError("CUDA out of memory (oracle, after BatchNorm)")
        self.micro_batches += 1
        return nn.functional.cross_entropy(self.head(hidden), y)

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_batchnorm_short_last_batch_is_not_cut_and_failed_forwards_leave_no_statistics() -> None:
    finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "oom"}]}, verbose=False, write_report=False)
    seed(0)
    model = BatchNormNet(capacity=4)  # batches 8, 8, 3: the 8s train as 4 + 4, the 3 whole (fits 4)
    _trainer(finder, max_epochs=1).fit(model)
    bn = model.body[1]
    assert model.micro_batches == 5  # 4 + 4 + ... no 1-sample piece, the last batch of 3 whole
    # one statistics update per micro-batch that trained; the two failed forwards' updates were taken back
    assert int(bn.num_batches_tracked) == model.micro_batches


def test_batchnorm_that_would_need_one_sample_pieces_is_a_clear_error() -> None:
    finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "oom"}]}, verbose=False, write_report=False)
    seed(0)
    with pytest.raises(RetuneError, match=r"BatchNorm layers in training mode.*cannot train on one sample"):
        _trainer(finder, max_epochs=1).fit(BatchNormNet(capacity=1, n=16))


# -- OOMs in the hooks around a step -----------------------------------------------------------


def _hook_model(hook: str) -> TokenModel:
    """A TokenModel whose ``hook`` runs out of memory once, on the first batch of 16."""

    class HookOOM(TokenModel):
        raised = False

    def fail(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.raised:
            self.raised = True
            raise torch.OutOfMemoryError(f"CUDA out of memory (oracle in {hook})")
        return args[0] if hook == "on_after_batch_transfer" else None

    setattr(HookOOM, hook, fail)
    return HookOOM(capacity=None)


@pytest.mark.parametrize("hook", ["on_before_backward", "on_before_zero_grad"])
def test_an_oom_in_a_hook_before_backward_is_recovered_exactly(hook: str) -> None:
    seed(0)
    base = TokenModel(capacity=None)
    _trainer(max_epochs=1).fit(base)
    seed(0)
    model = _hook_model(hook)
    finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "oom"}]}, verbose=False, write_report=False)
    trainer = _trainer(finder, max_epochs=1)
    trainer.fit(model)
    assert [e.note.split(" on a ")[0] for e in finder.history if e.is_recovery] == [f"out of memory in {hook}"]
    assert _max_diff(base, model) < 1e-5


@pytest.mark.parametrize(
    ("hook", "why"),
    [
        ("on_after_backward", "after the batch's gradients were complete"),
        ("on_before_optimizer_step", "after the batch's gradients were complete"),
        ("on_after_batch_transfer", "runs on the whole batch before training_step"),
        ("on_train_batch_start", "runs on the whole batch before training_step"),
    ],
)
def test_an_oom_in_a_hook_retune_cannot_split_is_the_original_error_with_a_note(hook: str, why: str) -> None:
    seed(0)
    finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "oom"}]}, verbose=False, write_report=False)
    with pytest.raises(torch.OutOfMemoryError, match=f"oracle in {hook}") as info:
        _trainer(finder, max_epochs=1).fit(_hook_model(hook))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert f"`{hook}`" in notes and why in notes
    assert not [e for e in finder.history if e.is_recovery]


# -- batches retune cannot split, found at fit start -------------------------------------------


def test_an_unsplittable_batch_fails_at_the_first_step_naming_the_field() -> None:
    class ExtraTensor(TokenModel):
        def train_dataloader(self) -> Any:
            def collate(samples: list[Any]) -> dict[str, torch.Tensor]:
                return {**pad_collate(samples), "class_weights": torch.ones(3)}

            return DataLoader(self.data, batch_size=16, collate_fn=collate)

    seed(0)
    finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "oom"}]}, verbose=False, write_report=False)
    trainer = _trainer(finder, max_epochs=1)
    with pytest.raises(SplitError, match=r"checks at fit start.*batch\['class_weights'\] has 3.*split_batch=fn"):
        trainer.fit(ExtraTensor(capacity=None))  # no step ran out of memory: found before any training
    assert trainer.global_step == 0


def test_a_packed_single_sample_batch_is_named_as_such() -> None:
    class Packed(TokenModel):
        def train_dataloader(self) -> Any:
            return DataLoader(self.data, batch_size=1, collate_fn=pad_collate)

    seed(0)
    finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "oom"}]}, verbose=False, write_report=False)
    with pytest.raises(RetuneError, match=r"batch of one sample along its first dimension.*packed"):
        _trainer(finder, max_epochs=1).fit(Packed(capacity=20))


def test_token_mean_and_loss_items_are_in_the_json_schema() -> None:
    import json

    from retune import RetuneSchedule

    text = json.dumps(RetuneSchedule.model_json_schema())
    assert '"token_mean"' in text and '"loss_items"' in text and "shifted_labels" in text
