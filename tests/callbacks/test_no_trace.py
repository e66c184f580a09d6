"""A re-tune that lands on the batch size already in use leaves no trace on the run.

Requirement: a run in which every search picks the size the run already uses ends bit-identical
to the same run without the callback: weights, buffers, optimizer and LR-scheduler state, loop
counters, the shuffled data order, ModelCheckpoint / EarlyStopping state and files, logged
metrics and what a CSVLogger wrote.

How the search is made to land on the same size: the memory oracle (tests/helpers/oracle.py) fixes the
true maximum ``M`` of a fully trainable model; a binsearch with ``margin=0.05`` returns
``S = int(M * 0.95)``. The model starts at ``S``, so the cold search at fit start and the warm
re-tunes at epochs 1 and 2 all answer ``S`` after probing real training steps at other sizes
(including ones that run out of memory). The run without the callback starts at ``S`` as well.

Two negative controls show the comparison can fail: a tune that lands on a different size, and a
callback that draws once from the data order's random generator at an epoch start.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from retune import ScheduledBatchSizeFinder
from tests.helpers.lightning_ns import PRECISION_32, PRECISION_BF16, callbacks, pl
from tests.helpers.oracle import FineTuneModel, MemoryOracle

CAPACITY = 1_900_000  # fully trainable model: M = 77, S = int(77 * 0.95) = 73
N = 1024  # 1024 = 14 * 73 + 2: 15 batches per epoch, an odd count ending in a partial batch
EPOCHS = 3
SEED = 1234
MARGIN = 0.05
SCHEDULE: dict[str, Any] = {
    "search": {"mode": "binsearch", "margin": MARGIN},
    "triggers": [{"kind": "fit_start"}, {"kind": "epoch", "at": [1, 2]}],
}


class RecordingModel(FineTuneModel):
    """``FineTuneModel`` that can shuffle with a generator of its own, kept across dataloaders.

    A generator kept on the model is the case where a probe's draws would shift every later
    epoch's order unless the probe puts the generator back.
    """

    def __init__(self, own_generator: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.generator = torch.Generator().manual_seed(4321) if own_generator else None

    def train_dataloader(self) -> DataLoader:
        if self.generator is None:
            return super().train_dataloader()
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=True, generator=self.generator)


class Recorder(pl.Callback):
    """What the real training loop fed and did, batch by batch. Probe steps are hidden from callbacks."""

    def __init__(self) -> None:
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.global_steps: list[int] = []
        self.lrs: list[list[float]] = []
        self.torch_rng: list[torch.Tensor] = []
        self.hook_calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.hook_calls[name] = self.hook_calls.get(name, 0) + 1

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.batches.append((x.detach().clone(), y.detach().clone()))
        self.global_steps.append(trainer.global_step)
        self.lrs.append([group["lr"] for opt in trainer.optimizers for group in opt.param_groups])
        self.torch_rng.append(torch.get_rng_state())

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._count("on_train_epoch_start")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._count("on_before_backward")

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._count("on_after_backward")

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any, *_: Any) -> None:
        self._count("on_before_optimizer_step")  # 1.9 also passes the optimizer index

    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._count("on_before_zero_grad")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._count("on_train_batch_end")


class GeneratorLeak(pl.Callback):
    """Negative control: one draw from the data order's generator at the start of epoch 1, never undone."""

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch == 1:
            generator = getattr(pl_module, "generator", None)
            torch.rand(1, generator=generator)


@dataclass(frozen=True)
class Case:
    optimizer: str = "sgd"
    scheduler: str | None = None
    accumulate: int = 1
    precision: str | int = PRECISION_32
    own_generator: bool = False
    validate: bool = False


CASES = {
    "sgd": Case("sgd"),
    "sgd-steplr": Case("sgd", "step"),
    "sgd-plateau": Case("sgd", "plateau"),
    "adamw": Case("adamw"),
    "adamw-steplr": Case("adamw", "step"),
    "adamw-plateau": Case("adamw", "plateau"),
    "sgd-steplr-accumulate2": Case("sgd", "step", accumulate=2),
    "adamw-accumulate2": Case("adamw", accumulate=2),
    "sgd-bf16": Case("sgd", precision=PRECISION_BF16),
    "adamw-plateau-bf16": Case("adamw", "plateau", precision=PRECISION_BF16),
    "sgd-own-generator": Case("sgd", own_generator=True),
    "adamw-steplr-validation": Case("adamw", "step", validate=True),
    "sgd-plateau-validation": Case("sgd", "plateau", validate=True),
    "everything": Case("adamw", "plateau", accumulate=2, precision=PRECISION_BF16, own_generator=True, validate=True),
}


@dataclass
class Outcome:
    """Everything compared between two runs; ``root`` is the run's own directory (paths are relative to it)."""

    root: Path
    finder: Any
    state: dict[str, Any] = field(default_factory=dict)


def _searched_size(capacity: int = CAPACITY) -> tuple[int, int]:
    """(M, S): the true maximum of the fully trainable model and the size binsearch with the margin returns."""
    true_max = FineTuneModel(oracle=MemoryOracle(capacity=capacity), n=8).phase_max(True)
    return true_max, max(1, int(true_max * (1 - MARGIN)))


def _fit(root: Path, case: Case, batch_size: int, with_finder: bool, extra: tuple[Any, ...] = ()) -> Outcome:
    root.mkdir(parents=True)
    monitor = "val_loss" if case.validate else "train_loss_epoch"
    pl.seed_everything(SEED)
    model = RecordingModel(
        own_generator=case.own_generator,
        batch_size=batch_size,
        oracle=MemoryOracle(capacity=CAPACITY),
        optimizer=case.optimizer,
        scheduler=case.scheduler,
        n=N,
        shuffle=True,
    )
    recorder = Recorder()
    checkpoint = callbacks.ModelCheckpoint(
        dirpath=str(root / "ckpt"),  # a str: 1.9 keeps a Path as given, in its state and in every checkpoint
        monitor=monitor,
        save_top_k=2,
        save_last=True,
        filename="{epoch}-{step}-{" + monitor + ":.6f}",
    )
    stopping = callbacks.EarlyStopping(monitor=monitor, patience=EPOCHS, min_delta=0.0)
    logger = pl.loggers.CSVLogger(save_dir=str(root), name="csv", version=0)
    finder = ScheduledBatchSizeFinder(SCHEDULE, verbose=False) if with_finder else None
    # the finder is listed first on purpose: it must move itself after every other callback
    cbs = [*([finder] if finder is not None else []), recorder, checkpoint, stopping, *extra]
    trainer = pl.Trainer(
        max_epochs=EPOCHS,
        callbacks=cbs,
        logger=logger,
        log_every_n_steps=1,
        accumulate_grad_batches=case.accumulate,
        precision=case.precision,
        limit_val_batches=2 if case.validate else 0,
        num_sanity_val_steps=1 if case.validate else 0,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(model)

    state: dict[str, Any] = {
        "data order (x)": [x for x, _ in recorder.batches],
        "data order (y)": [y for _, y in recorder.batches],
        "train batch sizes": list(model.train_batch_sizes),
        "global_step per batch": recorder.global_steps,
        "lr per batch": recorder.lrs,
        "torch RNG per batch": recorder.torch_rng,
        "callback hook calls": dict(recorder.hook_calls),
        "parameters": dict(model.named_parameters()),
        "buffers": dict(model.named_buffers()),
        "requires_grad": {name: p.requires_grad for name, p in model.named_parameters()},
        "grads": {name: p.grad for name, p in model.named_parameters()},
        "optimizer state_dict": [opt.state_dict() for opt in trainer.optimizers],
        "lr scheduler state_dict": [cfg.scheduler.state_dict() for cfg in trainer.lr_scheduler_configs],
        "global_step": trainer.global_step,
        "current_epoch": trainer.current_epoch,
        "should_stop": trainer.should_stop,
        "fit_loop state_dict": trainer.fit_loop.state_dict(),
        "ModelCheckpoint state_dict": _relative(checkpoint.state_dict(), root),
        "EarlyStopping state_dict": stopping.state_dict(),
        "callback_metrics": dict(trainer.callback_metrics),
        "logged_metrics": dict(trainer.logged_metrics),
        "progress_bar_metrics": dict(trainer.progress_bar_metrics),
        "checkpoint files": sorted(p.name for p in (root / "ckpt").iterdir()),
        "checkpoint contents": {p.name: _checkpoint_content(p, root) for p in sorted((root / "ckpt").iterdir())},
        "CSV metrics.csv": _without_retune_columns((root / "csv" / "version_0" / "metrics.csv").read_text()),
        "global RNG after fit": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        },
    }
    if model.generator is not None:
        state["model generator after fit"] = model.generator.get_state()
    return Outcome(root, finder, state)


def _without_retune_columns(text: str) -> list[dict[str, str]]:
    """metrics.csv less the finder's own documented output (retune/* columns, and rows that only hold them).

    Each row's columns are compared in name order: the CSV logger orders its header by first appearance,
    so on Lightning 1.9 the finder's own step-0 row (``retune/*`` and ``step``) moves ``step`` ahead of
    the metrics the model logs. Every value of every other column is still compared.
    """
    import csv
    import io

    rows = [
        {k: v for k, v in sorted(r.items()) if not k.startswith("retune/")} for r in csv.DictReader(io.StringIO(text))
    ]
    return [r for r in rows if any(v for k, v in r.items() if k not in ("epoch", "step"))]


def _checkpoint_content(path: Path, root: Path) -> dict[str, Any]:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    ckpt["callbacks"] = {k: v for k, v in ckpt.get("callbacks", {}).items() if "ScheduledBatchSizeFinder" not in k}
    return _relative(ckpt, root)


def _relative(obj: Any, root: Path) -> Any:
    """Replace the run's own directory in every path string, so two runs in two directories compare."""
    prefix = str(root)
    if isinstance(obj, str):
        return obj.replace(prefix, "<run>")
    if isinstance(obj, dict):
        return {_relative(k, root): _relative(v, root) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_relative(v, root) for v in obj)
    return obj


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor: bit-identical means -0.0 differs from 0.0 and NaN equals the same NaN."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _differences(a: Any, b: Any, path: str, out: list[str]) -> None:
    """Append a line to ``out`` for every place where ``a`` and ``b`` are not bit-identical."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            out.append(f"{path}: {type(a).__name__} vs {type(b).__name__}")
        elif a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
            out.append(f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
        elif not torch.equal(_bits(a), _bits(b)):
            out.append(f"{path}: tensor values differ")
        return
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)):
            out.append(f"{path}: arrays differ")
        return
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a.keys()) != list(b.keys()):
            out.append(f"{path}: keys {list(a.keys())} vs {list(b.keys())}")
        for key in a.keys() & b.keys():
            _differences(a[key], b[key], f"{path}[{key!r}]", out)
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            out.append(f"{path}: {type(a).__name__} of {len(a)} vs {type(b).__name__} of {len(b)}")
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            _differences(x, y, f"{path}[{i}]", out)
        return
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return
    if type(a) is not type(b) or a != b:
        out.append(f"{path}: {a!r} vs {b!r}")


def differences(with_finder: Outcome, without: Outcome) -> dict[str, list[str]]:
    """Per compared item, the lines where the two runs differ (empty dict: bit-identical)."""
    assert with_finder.state.keys() == without.state.keys()
    found: dict[str, list[str]] = {}
    for key in with_finder.state:
        out: list[str] = []
        _differences(with_finder.state[key], without.state[key], key, out)
        if out:
            found[key] = out
    return found


def _assert_retuned_to_same_size(finder: Any, size: int, true_max: int) -> None:
    history = finder.history
    assert [(e.epoch, e.trigger) for e in history] == [(0, "fit_start"), (1, "epoch"), (2, "epoch")]
    for event in history:
        assert event.batch_size_before == event.batch_size_after == size, event
        assert event.max_fitting == true_max, event
        # real probe steps ran, at sizes other than the one in use, and some of them ran out of memory
        assert any(t.fits and t.batch_size != size for t in event.trials), event.trials
        assert any(not t.fits for t in event.trials), event.trials
    assert finder.batch_size == size


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_retune_to_same_size_leaves_no_trace(case: Case, tmp_path: Path) -> None:
    true_max, size = _searched_size()
    assert 50 <= size <= 150 and N % size > 1  # many steps per epoch; no 1-sample batch for BatchNorm

    tuned = _fit(tmp_path / "with_finder", case, size, with_finder=True)
    _assert_retuned_to_same_size(tuned.finder, size, true_max)
    plain = _fit(tmp_path / "without", case, size, with_finder=False)

    # the runs did what the comparison assumes: full epochs at S, real optimizer steps
    batches_per_epoch = math.ceil(N / size)
    assert plain.state["train batch sizes"] == ([size] * (batches_per_epoch - 1) + [N % size]) * EPOCHS
    assert plain.state["global_step"] == EPOCHS * math.ceil(batches_per_epoch / case.accumulate)
    assert plain.state["checkpoint files"], "ModelCheckpoint saved nothing: the comparison would be vacuous"
    assert "train_loss_epoch" in plain.state["logged_metrics"]
    if case.validate:
        assert "val_loss" in plain.state["callback_metrics"]

    diffs = differences(tuned, plain)
    assert not diffs, "the re-tune left a trace:\n" + "\n".join(line for lines in diffs.values() for line in lines)


def test_negative_control_tune_to_a_different_size_is_detected(tmp_path: Path) -> None:
    """The same comparison fails when the tune changes the size: the check is not vacuous."""
    _, size = _searched_size()
    start = size - 9
    case = CASES["sgd"]
    tuned = _fit(tmp_path / "with_finder", case, start, with_finder=True)
    first = tuned.finder.history[0]
    assert (first.batch_size_before, first.batch_size_after) == (start, size)
    plain = _fit(tmp_path / "without", case, start, with_finder=False)

    diffs = differences(tuned, plain)
    assert "data order (x)" in diffs
    assert "parameters" in diffs
    assert "global_step" in diffs


@pytest.mark.parametrize("own_generator", [False, True], ids=["global-rng", "own-generator"])
def test_a_search_that_changes_the_size_trains_what_a_run_started_at_that_size_does(
    own_generator: bool, tmp_path: Path
) -> None:
    """The fit-start search moves the size (S - 9 -> S) and the loader is rebuilt: the rebuilt loader's iterator
    draws its base seed, a draw the run started at S never makes (it drew for the loader the rebuild replaces),
    so every later shuffle and dropout mask differed from that run's. The rebuild now gives the draw back (the
    global RNG, the loaders' own generators) and the new iterator the replaced one's seed: the two runs are
    bit-identical from the first step on."""
    _, size = _searched_size()
    case = Case("sgd", own_generator=own_generator)
    tuned = _fit(tmp_path / "with_finder", case, size - 9, with_finder=True)
    first = tuned.finder.history[0]
    assert (first.batch_size_before, first.batch_size_after) == (size - 9, size)
    plain = _fit(tmp_path / "without", case, size, with_finder=False)

    diffs = differences(tuned, plain)
    assert not diffs, "the search left a trace:\n" + "\n".join(line for lines in diffs.values() for line in lines)


@pytest.mark.parametrize("own_generator", [False, True], ids=["global-rng", "own-generator"])
def test_negative_control_one_unrestored_draw_is_detected(own_generator: bool, tmp_path: Path) -> None:
    """One draw from the shuffle's generator at an epoch start, not undone, changes the data order
    from that epoch on: exactly what a probe that did not restore the generator would do."""
    _, size = _searched_size()
    case = Case("sgd", own_generator=own_generator)
    leaky = _fit(tmp_path / "leaky", case, size, with_finder=False, extra=(GeneratorLeak(),))
    plain = _fit(tmp_path / "without", case, size, with_finder=False)

    diffs = differences(leaky, plain)
    assert "data order (x)" in diffs
    first_epoch = slice(0, math.ceil(N / size))
    leaky_first, plain_first = leaky.state["data order (x)"][first_epoch], plain.state["data order (x)"][first_epoch]
    assert all(torch.equal(x, y) for x, y in zip(leaky_first, plain_first, strict=True))  # before the leak
