"""The ``oom`` trigger: a real step that runs out of memory is trained again in micro-batches, nothing lost.

The OOMs come from ``tests/helpers/oom_oracle.py``, which raises the real ``torch.OutOfMemoryError`` when a
batch's padded token count exceeds a capacity, in forward or (variant) in backward after the head
already received its gradient. Every run is compared with the same run at unlimited capacity.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from retune import RetuneError, ScheduledBatchSizeFinder
from tests.helpers.lightning_ns import LEGACY, NAMESPACE, PRECISION_BF16, pl, seed
from tests.helpers.oom_oracle import TokenModel, pad_collate

OOM = {"triggers": [{"kind": "oom"}]}


def _fit(
    capacity: int | None,
    where: str = "forward",
    schedule: dict[str, Any] | None = None,
    epochs: int = 1,
    model_kwargs: dict[str, Any] | None = None,
    model_cls: type[TokenModel] = TokenModel,
    split_batch: Any = None,
    **trainer_kwargs: Any,
) -> tuple[TokenModel, ScheduledBatchSizeFinder, Any]:
    seed(0)
    model = model_cls(capacity=capacity, where=where, **(model_kwargs or {}))
    finder = ScheduledBatchSizeFinder(schedule or OOM, verbose=False, write_report=False, split_batch=split_batch)
    extra = trainer_kwargs.pop("callbacks_extra", [])
    trainer_kwargs.setdefault("enable_checkpointing", False)
    trainer = pl.Trainer(
        max_epochs=epochs,
        callbacks=[finder, *extra],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **trainer_kwargs,
    )
    trainer.fit(model)
    return model, finder, trainer


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize(
    "trainer_kwargs",
    [
        {},
        {"accumulate_grad_batches": 2},
        {"gradient_clip_val": 0.05},
        {"precision": PRECISION_BF16},
    ],
    ids=["plain", "accumulate", "clip", "bf16"],
)
def test_recovered_run_equals_a_run_with_enough_memory(where: str, trainer_kwargs: dict[str, Any]) -> None:
    base, _, base_trainer = _fit(None, **trainer_kwargs)
    model, finder, trainer = _fit(300, where, **trainer_kwargs)
    recoveries = [e for e in finder.history if e.trigger == "oom"]
    assert recoveries, "the capacity must make some steps run out of memory"
    assert all(e.micro_batches >= 2 and e.stage == "train" for e in recoveries)
    assert trainer.global_step == base_trainer.global_step
    assert set(model.trained.values()) == {1} and len(model.trained) == len(model.data)  # each sample once
    tolerance = 1e-2 if "precision" in trainer_kwargs else 1e-5
    assert _max_diff(base, model) < tolerance
    base_loss = base_trainer.callback_metrics["train_loss"]
    assert torch.allclose(trainer.callback_metrics["train_loss"], base_loss, atol=tolerance)


class LogsBeforeForward(TokenModel):
    """Logs the samples it sees *before* the forward that runs out of memory: the failed attempt's value must
    be taken back, or the epoch's sum would count those samples twice."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        n = float(len(batch["labels"]))
        self.log("samples", n, on_step=False, on_epoch=True, reduce_fx="sum", batch_size=int(n))
        self.log("first_seen", n, on_step=True, on_epoch=False)
        return super().training_step(batch, batch_idx)


def test_values_logged_before_a_forward_oom_are_taken_back() -> None:
    model, finder, trainer = _fit(300, "forward", model_cls=LogsBeforeForward)
    assert any(e.is_recovery and "forward" in e.note for e in finder.history)
    assert trainer.callback_metrics["samples"].item() == len(model.data)


def test_adamw_and_accumulation_inside_a_window_in_backward() -> None:
    """Backward OOM on the second batch of an accumulation window: the first batch's gradients survive."""
    kwargs = {"model_kwargs": {"optimizer": "adamw", "lr": 0.01}, "accumulate_grad_batches": 3}
    base, _, _ = _fit(None, **kwargs)  # type: ignore[arg-type]
    model, finder, _ = _fit(300, "backward", **kwargs)  # type: ignore[arg-type]
    assert any(e.trigger == "oom" for e in finder.history)
    assert _max_diff(base, model) < 1e-5


def test_next_epoch_searches_below_the_failed_size_and_fits() -> None:
    schedule = {"triggers": [{"kind": "oom"}], "search": {"steps_per_trial": 1}}
    model, finder, _ = _fit(300, "forward", schedule, epochs=3, model_kwargs={"shuffle": False})
    searches = [e for e in finder.history if not e.is_recovery]
    assert searches and searches[0].trigger == "oom" and searches[0].epoch == 1
    assert searches[0].batch_size_after < 16
    assert searches[0].min_failing is not None and searches[0].min_failing <= 16
    # each re-search lands below every size that failed before it: the run converges on a size that fits
    failed = 16
    for search in searches:
        assert search.batch_size_after < failed
        failed = min(
            [failed] + [e.batch_size_after for e in finder.history if e.is_recovery and e.epoch == search.epoch]
        )
    assert model.batch_sizes[-1] <= searches[-1].batch_size_after


def test_with_largest_probes_the_next_epoch_runs_at_a_size_that_fits_every_batch() -> None:
    """``probe_samples: largest`` makes the re-search see the worst batch: no step of later epochs fails."""
    schedule = {"triggers": [{"kind": "oom"}], "search": {"steps_per_trial": 1, "probe_samples": "largest"}}
    model, finder, trainer = _fit(300, "forward", schedule, epochs=3, model_kwargs={"shuffle": True})
    searches = [e for e in finder.history if not e.is_recovery]
    assert [e.epoch for e in searches] == [1] and searches[0].trigger == "oom"
    assert max(model.batch_sizes[-len(model.data) // searches[0].batch_size_after :]) <= searches[0].batch_size_after
    assert not [e for e in finder.history if e.is_recovery and e.epoch >= 1]
    assert trainer.current_epoch == 3


def test_a_mid_epoch_checkpoint_keeps_the_split(tmp_path: Any) -> None:
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    _, finder, _ = _fit(300, "forward", enable_checkpointing=True, callbacks_extra=[checkpoints])
    path = sorted(tmp_path.glob("*step=3*.ckpt"))[0]
    saved = torch.load(path, weights_only=False)["callbacks"][finder.state_key]
    assert saved["oom_max_size"] is not None and saved["oom_max_size"] <= 8
    resumed = ScheduledBatchSizeFinder(OOM, verbose=False)
    resumed.load_state_dict(saved)
    assert resumed._recovery is not None and resumed._recovery.resumed_split == (saved["oom_max_size"], 1)
    if LEGACY:
        return  # pytorch-lightning 1.9 loads checkpoints with torch.load's weights_only default: torch 2.6+ refuses
    # resumed mid-epoch, the epoch goes on with the kept split: no whole-batch attempt runs out of memory first
    seed(0)
    model = TokenModel(capacity=300)
    finder = ScheduledBatchSizeFinder(OOM, verbose=False, write_report=False)
    trainer = pl.Trainer(
        max_epochs=1,
        callbacks=[finder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, ckpt_path=str(path))
    resumed_events = [e for e in finder.history if e.is_recovery and e.stage == "train" and e.global_step >= 3]
    assert not [e for e in resumed_events if "in forward" in e.note]


def test_the_callback_pickles_for_ddp_spawn() -> None:
    import pickle

    finder = pickle.loads(pickle.dumps(ScheduledBatchSizeFinder(OOM, verbose=False)))
    assert [t.kind for t in finder.triggers] == ["oom"]


def test_a_single_sample_that_does_not_fit_is_a_clear_error() -> None:
    with pytest.raises(RetuneError, match=r"one sample does not fit.*") as info:
        _fit(2, "forward")
    assert "global step 0" in str(info.value) and "16 samples" in str(info.value)


def test_custom_batch_needs_a_split_function() -> None:
    class Batch:
        def __init__(self, data: dict[str, torch.Tensor]) -> None:
            self.data = data

    class CustomBatchModel(TokenModel):
        def train_dataloader(self) -> Any:
            return DataLoader(self.data, batch_size=self.batch_size, collate_fn=lambda s: Batch(pad_collate(s)))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return super().training_step(batch.data, batch_idx)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            pass

    def fit(split: Any) -> Any:
        return _fit(300, "forward", model_cls=CustomBatchModel, split_batch=split)[0]

    with pytest.raises(TypeError, match=r"cannot split a batch of type .*Batch.*split_batch=fn"):
        fit(None)

    from retune.recovery.split import split_batch

    model = fit(lambda batch, pieces: [Batch(part) for part in split_batch(batch.data, pieces)])
    assert set(model.trained.values()) == {1}


def test_manual_optimization_is_refused_with_the_way_out() -> None:
    class Manual(TokenModel):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    trainer = pl.Trainer(
        max_epochs=1,
        callbacks=[ScheduledBatchSizeFinder(OOM, verbose=False)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(RetuneError, match="manual optimization"):
        trainer.fit(Manual())


def test_evaluation_steps_recover_and_predictions_come_back_whole() -> None:
    seed(0)
    full = TokenModel(capacity=None)
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    expected = trainer.predict(full)
    expected_val = trainer.validate(full, verbose=False)

    small = TokenModel(capacity=300)
    small.load_state_dict(full.state_dict())
    finder = ScheduledBatchSizeFinder(OOM, verbose=False, write_report=False)
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[finder])
    got = trainer.predict(small)
    assert got is not None and expected is not None and len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a["index"], b["index"]) and torch.allclose(a["logits"], b["logits"], atol=1e-6)
    got_val = trainer.validate(small, verbose=False)
    assert got_val[0]["val_loss"] == pytest.approx(expected_val[0]["val_loss"], abs=1e-6)
    stages = {e.stage for e in finder.history if e.is_recovery}
    assert stages == {"predict", "val"}
    assert small.predict_step.__func__ is TokenModel.predict_step  # unwrapped after the loop


def test_evaluation_recovers_with_loaders_given_to_the_trainer_and_no_batch_size_attribute() -> None:
    class NoAttr(TokenModel):
        def __init__(self) -> None:
            super().__init__(capacity=300)
            del self.batch_size

    model = NoAttr()
    loader = DataLoader(model.data, batch_size=16, collate_fn=pad_collate)
    finder = ScheduledBatchSizeFinder(OOM, verbose=False, write_report=False)
    trainer = pl.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[finder])
    predictions = trainer.predict(model, dataloaders=loader)
    assert predictions is not None and sum(len(p["index"]) for p in predictions) == len(model.data)
    event = next(e for e in finder.history if e.is_recovery)
    assert event.stage == "predict" and event.batch_size_after == 16


def test_recovery_is_in_history_table_and_state_dict() -> None:
    _, finder, _ = _fit(300, "forward")
    event = next(e for e in finder.history if e.is_recovery)
    assert event.trigger == "oom" and event.batch_size_before == event.batch_size_after == 16
    assert "micro-batches" in event.note
    from retune.reports import batch_size as report

    table = report.format_table(finder.history)
    assert "recovered out-of-memory step" in table and "split" in table
    restored = ScheduledBatchSizeFinder(OOM, verbose=False)
    restored.load_state_dict(finder.state_dict())
    assert restored.history == finder.history


@pytest.mark.skipif(LEGACY, reason="pytorch-lightning 1.9 has no fp16 precision plugin for CPU")
def test_fp16_with_its_grad_scaler() -> None:
    """Lightning turns ``precision="16-mixed"`` into bf16 on CPU, so the plugin is built explicitly: fp16
    autocast with a real ``GradScaler``, whose scaled gradients the recovery must accumulate unchanged."""
    precision = importlib.import_module(NAMESPACE + ".plugins.precision")

    def plugin() -> Any:
        return precision.MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))

    base, _, base_trainer = _fit(None, "backward", plugins=[plugin()])
    model, finder, trainer = _fit(300, "backward", plugins=[plugin()])
    assert trainer.precision_plugin.scaler is not None and trainer.precision_plugin.precision == "16-mixed"
    assert any(e.is_recovery for e in finder.history)
    assert trainer.precision_plugin.scaler.get_scale() == base_trainer.precision_plugin.scaler.get_scale()
    assert _max_diff(base, model) < 1e-4


class HeavyLastBatch(TokenModel):
    """One sample (the last) costs ten times its tokens: the first batches, which a search probes, fit at sizes
    the epoch's last batch runs out of memory at."""

    def _tokens(self, batch: dict[str, torch.Tensor]) -> int:
        heavy = len(self.data) - 1 in batch["index"].tolist()
        return int(batch["input_ids"].numel()) * (10 if heavy else 1)


@pytest.mark.parametrize("mode", ["power", "binsearch"])
def test_a_size_that_failed_in_training_is_not_used_again_by_a_later_search(mode: str) -> None:
    """An epoch milestone's search probes the first batches, where a size that ran out of memory on a later
    batch fits: that size (and any larger) stays out of reach until the memory shrinks. Before, the milestone
    went back to it and the run alternated between running out of memory and recovering."""
    schedule = {
        "triggers": [{"kind": "oom"}, {"kind": "epoch", "every": 1}],
        "search": {"steps_per_trial": 1, "mode": mode, "init_val": 16},
    }
    _, finder, _ = _fit(2000, "forward", schedule, epochs=4, model_kwargs={"shuffle": False}, model_cls=HeavyLastBatch)
    shown = [(e.trigger, e.epoch, e.batch_size_after, e.min_failing) for e in finder.history]
    failed: int | None = None
    for event in finder.history:
        if event.is_recovery:
            continue
        if failed is not None:
            assert event.batch_size_after < failed, shown
        if "oom" in event.trigger and event.min_failing is not None:
            failed = event.min_failing if failed is None else min(failed, event.min_failing)
    assert failed is not None, shown  # the capacity makes a real step run out of memory
    assert any(e.trigger == "epoch" for e in finder.history), shown  # and a milestone searches after it


def test_a_size_that_failed_in_training_is_kept_in_the_checkpoint() -> None:
    from retune.search.stage import StageState

    state = StageState.from_dict({**StageState(size=8).to_dict(), "failed_in_training": 12})
    assert state.failed_in_training == 12 and StageState.from_dict(state.to_dict()) == state


class RawSamples(TokenModel):
    """``collate_fn=lambda b: b``: the step gets the dataset's samples in a list and pads them itself."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return super().training_step(pad_collate(batch), batch_idx)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.batch_sizes.append(len(batch))

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.data, batch_size=self.batch_size, collate_fn=lambda samples: samples)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_list_of_raw_samples_recovers_sample_by_sample(where: str) -> None:
    """A list of sample dicts was read by their fields (the first sample's ids' length): refused at fit start where
    the lengths differ, and where they agree, split along each sample's tokens (every micro-batch held every sample)."""
    base, _, base_trainer = _fit(None, model_cls=RawSamples)
    model, finder, trainer = _fit(300, where, model_cls=RawSamples)
    recoveries = [e for e in finder.history if e.trigger == "oom"]
    assert recoveries and all(e.micro_batches >= 2 for e in recoveries), "some steps must run out of memory"
    # each micro-batch pads its own samples, so a round can fail partway: `trained` counts the backwards of the
    # rounds taken back too, and the update is what says every sample counted once
    assert set(model.trained) == set(range(len(model.data)))
    assert trainer.global_step == base_trainer.global_step and model.batch_sizes == base.batch_sizes
    assert _max_diff(base, model) < 1e-5


class TripleInputs(pl.LightningModule):  # type: ignore[misc,name-defined]
    """A Hugging Face-style ``((input_ids, attention_mask, token_type_ids), labels)`` batch; 43 samples in batches of 8,
    so the last holds 3, as many samples as the triple has tensors. Above ``capacity`` samples a step runs out of
    memory (the real error type)."""

    def __init__(self, capacity: int | None) -> None:
        super().__init__()
        self.capacity = capacity
        self.batch_size = 8
        g = torch.Generator().manual_seed(0)
        self.data = torch.utils.data.TensorDataset(
            torch.randint(1, 20, (43, 6), generator=g),
            torch.ones(43, 6, dtype=torch.long),
            torch.zeros(43, 6, dtype=torch.long),
            torch.randint(0, 3, (43,), generator=g),
        )
        self.embed = torch.nn.Embedding(20, 8)
        self.head = torch.nn.Linear(8, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids, mask, types), labels = batch
        if self.capacity is not None and len(labels) > self.capacity:
            raise torch.OutOfMemoryError(f"CUDA out of memory (oracle: {len(labels)} > {self.capacity})")
        hidden = (self.embed(ids) * mask.unsqueeze(-1) + types.unsqueeze(-1)).mean(1)
        return torch.nn.functional.cross_entropy(self.head(hidden), labels)

    def train_dataloader(self) -> DataLoader[Any]:
        def collate(samples: list[Any]) -> Any:
            ids, mask, types, labels = (torch.stack(column) for column in zip(*samples, strict=True))
            return (ids, mask, types), labels

        return DataLoader(self.data, batch_size=self.batch_size, collate_fn=collate)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_last_batch_as_long_as_a_tuple_of_inputs_is_split_along_its_rows() -> None:
    """The last batch of 3 beside a triple of inputs reads both ways; it was split as one tensor per sample (the fit
    died unpacking two tensors at its last step). It is split as the first batch read: three batches of rows."""
    runs = []
    for capacity in (None, 2):
        seed(0)
        model = TripleInputs(capacity)
        finder = ScheduledBatchSizeFinder(OOM, verbose=False, write_report=False)
        trainer = pl.Trainer(
            max_epochs=1,
            callbacks=[finder] if capacity else [],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model)
        runs.append((model, trainer.global_step))
    (base, base_steps), (model, steps) = runs
    assert steps == base_steps == 6 and _max_diff(base, model) < 1e-6
