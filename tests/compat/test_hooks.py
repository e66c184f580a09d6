"""Every step hook is called the way Lightning calls it, in probes and in out-of-memory recovery.

Lightning inspects a step's signature before calling it: ``training_step(self, batch)`` without
``batch_idx`` is valid, and so are evaluation steps without ``batch_idx`` (2.x) or with
``dataloader_idx`` (several loaders). Each model here records how many arguments after the batch
every call of its step received, from Lightning's loop and from retune's probes alike, and the
steps raise the real ``torch.OutOfMemoryError`` above ``CAPACITY`` samples (an oracle: no GPU here),
so the searches have something to find and the recovery something to recover.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from retune import ScheduledBatchSizeFinder
from retune.compat.hooks import check_probeable, keep_signature, step_args
from retune.errors import RetuneError
from tests.helpers.lightning_ns import LEGACY, pl, seed

N = 64
CAPACITY = 20  # samples a step can hold
ONLY_2X = pytest.mark.skipif(LEGACY, reason="Lightning 1.9 always passes batch_idx to evaluation steps")
SEARCH = {"mode": "binsearch", "margin": 0.0, "steps_per_trial": 1, "init_val": 2, "max_val": 64}


def decorated(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator like many users write (logging, timing): ``(*args, **kwargs)`` with ``functools.wraps``."""

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return inner


class Steps(pl.LightningModule):  # type: ignore[misc,name-defined]
    """A linear model whose steps record ``(hook, arguments after the batch)``; out of memory above ``capacity``."""

    def __init__(self, capacity: int = CAPACITY, loaders: int = 1, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.val_batch_size = self.test_batch_size = self.predict_batch_size = batch_size
        self.capacity = capacity
        self.loaders = loaders
        self.net = nn.Linear(4, 1)
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g))
        self._calls: list[tuple[str, int]] = []

    def run(self, hook: str, batch: Any, extra: tuple[Any, ...]) -> torch.Tensor:
        self._calls.append((hook, len(extra)))
        x, y = batch
        if x.shape[0] > self.capacity:
            raise torch.OutOfMemoryError("CUDA out of memory (test oracle)")
        return F.mse_loss(self.net(x), y)

    def arities(self, hook: str) -> set[int]:
        return {n for name, n in self._calls if name == hook}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.data, batch_size=self.batch_size)

    def _eval_loaders(self, size: int) -> Any:
        loaders = [DataLoader(self.data, batch_size=size) for _ in range(self.loaders)]
        return loaders if self.loaders > 1 else loaders[0]

    def val_dataloader(self) -> Any:
        return self._eval_loaders(self.val_batch_size)

    def test_dataloader(self) -> Any:
        return self._eval_loaders(self.test_batch_size)

    def predict_dataloader(self) -> Any:
        return self._eval_loaders(self.predict_batch_size)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.run("training_step", batch, (batch_idx,))

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.run("validation_step", batch, (batch_idx,))

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.run("test_step", batch, (batch_idx,))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.run("predict_step", batch, (batch_idx,))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _step(hook: str, form: str) -> Callable[..., Any]:
    """A step of ``form``: the signatures users write, each valid Lightning."""
    if form == "batch":

        def step(self: Steps, batch: Any) -> Any:
            return self.run(hook, batch, ())

    elif form == "batch_idx":

        def step(self: Steps, batch: Any, batch_idx: int) -> Any:  # type: ignore[misc]
            return self.run(hook, batch, (batch_idx,))

    elif form == "dataloader_idx":

        def step(self: Steps, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:  # type: ignore[misc]
            return self.run(hook, batch, (batch_idx, dataloader_idx))

    elif form == "varargs":

        def step(self: Steps, batch: Any, *args: Any) -> Any:  # type: ignore[misc]
            return self.run(hook, batch, args)

    else:
        assert form == "decorated"

        @decorated
        def step(self: Steps, batch: Any) -> Any:  # type: ignore[misc]
            return self.run(hook, batch, ())

    return step


def _model(hook: str, form: str, **kwargs: Any) -> Steps:
    cls = type(f"{hook}_{form}", (Steps,), {hook: _step(hook, form)})
    return cls(**kwargs)  # type: ignore[no-any-return]


# what Lightning passes after the batch: (form, loaders) -> count
EXPECTED = {"batch": 0, "batch_idx": 1, "varargs": 1, "decorated": 0, "dataloader_idx": 2}
TRAIN_FORMS = [
    "batch",
    "batch_idx",
    "varargs",
    pytest.param("decorated", marks=pytest.mark.skipif(LEGACY, reason="1.9 does not unwrap decorators")),
]
EVAL_FORMS = [
    pytest.param("batch", marks=ONLY_2X),
    "batch_idx",
    "varargs",
    "dataloader_idx",
    pytest.param("decorated", marks=ONLY_2X),
]


def _trainer(finder: ScheduledBatchSizeFinder | None, **kwargs: Any) -> Any:
    options: dict[str, Any] = {
        "max_epochs": 1,
        "accelerator": "cpu",
        "devices": 1,
        "limit_train_batches": 2,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "callbacks": [] if finder is None else [finder],
    }
    options.update(kwargs)
    return pl.Trainer(**options)


# -- probes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", TRAIN_FORMS)
def test_training_step_probes_get_the_arguments_lightning_passes(form: str) -> None:
    """``training_step(self, batch)`` crashed every search with a TypeError before issue 20."""
    seed(0)
    model = _model("training_step", form)
    finder = ScheduledBatchSizeFinder({"search": SEARCH, "triggers": [{"kind": "fit_start"}]}, verbose=False)
    _trainer(finder).fit(model)
    assert finder.batch_size == CAPACITY
    assert len(model._calls) == len(finder.history[0].trials) + 2, "one step per trial, then the two real steps"
    assert model.arities("training_step") == {EXPECTED[form]}


def test_manual_optimization_step_without_batch_idx_is_probed() -> None:
    class Manual(Steps):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any) -> None:  # type: ignore[override]
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(self.run("training_step", batch, ()))
            optimizer.step()

    seed(0)
    model = Manual()
    finder = ScheduledBatchSizeFinder({"search": SEARCH, "triggers": [{"kind": "fit_start"}]}, verbose=False)
    _trainer(finder).fit(model)
    assert finder.batch_size == CAPACITY and model.arities("training_step") == {0}


def _run_stage(trainer: Any, stage: str, model: Steps) -> None:
    if stage == "val":
        trainer.validate(model, verbose=False)
    elif stage == "test":
        trainer.test(model, verbose=False)
    else:
        trainer.predict(model)


HOOKS = {"val": "validation_step", "test": "test_step", "predict": "predict_step"}


@pytest.mark.parametrize("stage", ["val", "test", "predict"])
@pytest.mark.parametrize("form", EVAL_FORMS)
def test_evaluation_step_probes_get_the_arguments_lightning_passes(stage: str, form: str) -> None:
    seed(0)
    loaders = 2 if form == "dataloader_idx" else 1
    model = _model(HOOKS[stage], form, loaders=loaders)
    schedule = {"search": SEARCH, "triggers": [{"kind": "fit_start"}], "stages": [stage]}
    finder = ScheduledBatchSizeFinder(schedule, verbose=False, write_report=False)
    _run_stage(_trainer(finder, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2), stage, model)
    assert finder.batch_sizes[stage] == CAPACITY
    assert model.arities(HOOKS[stage]) == {EXPECTED[form]}


# -- out-of-memory recovery -----------------------------------------------------------------------


@pytest.mark.parametrize("form", TRAIN_FORMS)
def test_training_step_recovery_calls_the_step_as_lightning_does(form: str) -> None:
    seed(0)
    model = _model("training_step", form, batch_size=32)  # every real step runs out of memory whole
    finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "oom"}]}, verbose=False, write_report=False)
    trainer = _trainer(finder)
    trainer.fit(model)
    assert trainer.state.finished and trainer.global_step == 2
    recovered = [e for e in finder.history if e.is_recovery]
    assert recovered and recovered[0].micro_batches == 2
    assert model.arities("training_step") == {EXPECTED[form]}


@pytest.mark.parametrize("stage", ["val", "test", "predict"])
@pytest.mark.parametrize("form", EVAL_FORMS)
def test_evaluation_step_recovery_calls_the_step_as_lightning_does(stage: str, form: str) -> None:
    seed(0)
    loaders = 2 if form == "dataloader_idx" else 1
    model = _model(HOOKS[stage], form, loaders=loaders, batch_size=32)
    finder = ScheduledBatchSizeFinder({"triggers": [{"kind": "oom"}]}, verbose=False, write_report=False)
    _run_stage(_trainer(finder, limit_val_batches=2, limit_test_batches=2, limit_predict_batches=2), stage, model)
    recovered = [e for e in finder.history if e.is_recovery and e.stage == stage]
    assert recovered and recovered[0].micro_batches == 2
    assert model.arities(HOOKS[stage]) == {EXPECTED[form]}
    assert HOOKS[stage] not in vars(model), "the step is put back after the loop"


# -- the rules themselves, against Lightning's own inspection ---------------------------------------


class _Signatures(pl.LightningModule):  # type: ignore[misc,name-defined]
    def training_step(self, batch: Any) -> None: ...

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...

    def test_step(self, batch: Any, idx: int) -> None: ...  # any name: a second parameter is batch_idx

    @decorated
    def predict_step(self, batch: Any) -> None: ...


def test_step_args_follow_lightnings_inspection() -> None:
    trainer, module = pl.Trainer(logger=False), _Signatures()
    assert step_args(trainer, module, "train", "b", 3) == ("b",)
    assert step_args(trainer, module, "val", "b", 3, 1) == ("b", 3, 1)
    assert step_args(trainer, module, "val", "b", 3) == ("b", 3)
    assert step_args(trainer, module, "test", "b", 3) == ("b", 3)
    # 2.x unwraps the decorator and sees no batch_idx; 1.9 reads the decorator's *args and passes it
    assert step_args(trainer, module, "predict", "b", 3) == (("b", 3) if LEGACY else ("b",))


@pytest.mark.skipif(LEGACY, reason="1.9 reads a replacement's own signature; it passes eval steps batch_idx anyway")
def test_a_replaced_step_keeps_what_lightning_inspects() -> None:
    """2.x unwraps one ``__wrapped__`` level: a replacement of a decorated step must not expose the decorator."""
    sig = importlib.import_module(pl.__name__ + ".utilities.signature_utils")
    module = _Signatures()
    for name in ("validation_step", "predict_step"):
        step = getattr(module, name)
        replacement = keep_signature(functools.partial(step), step)
        for param, kwargs in (("batch_idx", {"min_args": 2}), ("dataloader_idx", {})):
            want = sig.is_param_in_hook_signature(step, param, **kwargs)
            assert sig.is_param_in_hook_signature(replacement, param, **kwargs) == want, (name, param)


def test_a_dataloader_iter_step_is_refused_with_the_way_out() -> None:
    class IterStep(Steps):
        def training_step(self, dataloader_iter: Any) -> Any:  # type: ignore[override]
            return self.run("training_step", next(dataloader_iter)[0], ())

    with pytest.raises(RetuneError, match=r"IterStep.training_step takes `dataloader_iter`.*remove 'train'"):
        check_probeable(pl.Trainer(logger=False), IterStep(), "train")
    check_probeable(pl.Trainer(logger=False), Steps(), "train")  # a batch step passes


@pytest.mark.skipif(not LEGACY, reason="truncated BPTT was removed in Lightning 2.0")
def test_truncated_bptt_probes_the_first_split_with_hiddens() -> None:
    """1.9 runs ``training_step(split, batch_idx, hiddens)`` on each time split; the probe runs the first."""

    class Sequence(Steps):
        def __init__(self) -> None:
            super().__init__()
            self.truncated_bptt_steps = 2
            g = torch.Generator().manual_seed(0)
            self.data = TensorDataset(torch.randn(N, 6, 4, generator=g), torch.randn(N, 6, 1, generator=g))
            self._hiddens: list[Any] = []
            self._lengths: list[int] = []

        def training_step(self, batch: Any, batch_idx: int, hiddens: Any) -> Any:  # type: ignore[override]
            self._hiddens.append(hiddens)
            self._lengths.append(int(batch[0].shape[1]))
            x, y = batch
            if x.shape[0] > self.capacity:
                raise torch.OutOfMemoryError("CUDA out of memory (test oracle)")
            return {"loss": F.mse_loss(self.net(x), y), "hiddens": torch.zeros(1)}

    seed(0)
    model = Sequence()
    finder = ScheduledBatchSizeFinder({"search": SEARCH, "triggers": [{"kind": "fit_start"}]}, verbose=False)
    _trainer(finder).fit(model)
    assert finder.batch_size == CAPACITY
    trials = len(finder.history[0].trials)
    assert model._lengths[:trials] == [2] * trials and model._hiddens[:trials] == [None] * trials
    assert len(model._lengths) == trials + 2 * 3  # then each real batch as 3 splits of 2 time steps
