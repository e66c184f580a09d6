"""One real step of a stage, run outside the loop as the loop runs it, with its hooks hidden.

Internals used and why: the active loop's ``_results`` collection and the module's
``_current_fx_name``, swapped during a probe so that ``self.log`` in the user's step works and nothing
it logs survives the probe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Protocol

import torch

from retune.compat import hooks as hook_calls
from retune.compat.distributed import is_ddp
from retune.compat.logs import results_owner, throwaway_results
from retune.compat.loops import eval_loop
from retune.compat.namespace import import_module, is_legacy, namespace_of
from retune.errors import RetuneError


class StepMarks(Protocol):
    """Told where a training step is (:func:`step_marks`): what a memory account of its phases needs."""

    def forward_done(self) -> None:
        """``training_step`` returned; ``zero_grad`` comes next (the step before's gradients are still alive)."""

    def backward_done(self) -> None:
        """Backward is done; gradient clipping and the optimizer's update come next."""


_MARKS: ContextVar[StepMarks | None] = ContextVar("retune_step_marks", default=None)


@contextmanager
def step_marks(marks: StepMarks | None) -> Iterator[None]:
    """Training steps run inside the block tell ``marks`` their phases (automatic optimization only: a manual step
    is the user's own)."""
    token = _MARKS.set(marks)
    try:
        yield
    finally:
        _MARKS.reset(token)


def _zero_grad(trainer: Any, pl_module: Any, optimizer: Any, batch_idx: int) -> None:
    """The module's ``optimizer_zero_grad`` hook (``optimizer.zero_grad()`` unless overridden), as the loop calls it:
    at the first batch of an accumulation window only (``batch_idx % accumulate_grad_batches == 0``; a probe's
    steps count from 0), so a later micro-batch's backward holds the gradients accumulated so far."""
    if batch_idx % max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1)) != 0:
        return
    if is_legacy(trainer):
        pl_module.optimizer_zero_grad(trainer.current_epoch, batch_idx, optimizer, 0)
    else:
        pl_module.optimizer_zero_grad(trainer.current_epoch, batch_idx, optimizer)


def _loss_of(output: Any) -> torch.Tensor | None:
    if output is None:
        return None
    if isinstance(output, torch.Tensor):
        return output
    loss = output.get("loss") if isinstance(output, Mapping) else None
    if isinstance(loss, torch.Tensor):
        return loss
    raise RetuneError(
        f"training_step returned {type(output).__name__}; Lightning expects a loss tensor, "
        "a dict with a 'loss' key, or None"
    )


@contextmanager
def _no_ddp_sync(trainer: Any) -> Iterator[None]:
    """Keep DDP's reducer out of probe steps.

    A probe runs the unwrapped LightningModule, so DDP's forward never prepares the reducer and its
    gradient hooks return without communicating; manual optimization's ``manual_backward`` would
    prepare it through ``strategy.pre_backward``, which is silenced here. No collective runs inside
    a probe step, so a rank that runs out of memory cannot leave the others waiting.
    """
    strategy = trainer.strategy
    saved = {name: strategy.__dict__.get(name) for name in ("pre_backward", "post_backward")}
    strategy.pre_backward = lambda *args, **kwargs: None
    strategy.post_backward = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                strategy.__dict__.pop(name, None)
            else:
                setattr(strategy, name, value)


def _forward(trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> Any:
    """The user's ``training_step``, with the arguments Lightning would pass it (``hook_calls``)."""
    strategy = trainer.strategy
    if is_ddp(trainer):
        with strategy.precision_plugin.train_step_context():
            return hook_calls.call_step(trainer, pl_module, "train", batch, batch_idx)
    return strategy.training_step(*hook_calls.step_args(trainer, pl_module, "train", batch, batch_idx))


_EVAL_STEPS = {"val": ("validation_step", "val_step_context"), "test": ("test_step", "test_step_context")}
_EVAL_STEPS["predict"] = ("predict_step", "predict_step_context")


def run_step(
    trainer: Any, pl_module: Any, stage: str, batch: Any, batch_idx: int, dataloader_idx: int | None = None
) -> None:
    """One real step of ``stage``: a training step, or an evaluation step as Lightning runs it (eval
    mode is set by the caller; no gradients, under ``inference_mode`` when the trainer uses it), with
    ``dataloader_idx`` as its third argument unless it is None (see ``eval_dataloaders``)."""
    if stage == "train":
        training_step(trainer, pl_module, batch, batch_idx)
        return
    _, context_name = _EVAL_STEPS[stage]
    precision = trainer.strategy.precision_plugin
    use_inference_mode = (
        trainer._inference_mode if is_legacy(trainer) else getattr(eval_loop(trainer, stage), "inference_mode", True)
    )
    no_grad = torch.inference_mode() if use_inference_mode else torch.no_grad()
    with no_grad, getattr(precision, context_name)():
        hook_calls.call_step(trainer, pl_module, stage, batch, batch_idx, dataloader_idx)


ClosureWrapper = Callable[[Callable[[], "torch.Tensor | None"]], Callable[[], "torch.Tensor | None"]]


def training_step(
    trainer: Any, pl_module: Any, batch: Any, batch_idx: int, wrap_closure: ClosureWrapper | None = None
) -> torch.Tensor | None:
    """One real training step: forward, backward and optimizer step under the trainer's strategy and
    precision (autocast, grad scaler), without the loop's bookkeeping. Under DDP the step runs on the
    unwrapped module with the reducer kept out (see ``_no_ddp_sync``): same memory, no collectives.

    As the loop runs it: ``zero_grad`` (the module's ``optimizer_zero_grad``) after ``training_step`` and
    before backward, so the gradients of the step before are alive in the forward, and what ``training_step``
    returned (a dict's logits too) alive until the update is done. Inside :func:`step_marks` the step tells its
    marks where it is.

    Returns the step's loss (None when ``training_step`` returned None). ``wrap_closure`` wraps the
    forward-and-backward closure (automatic optimization), so a caller can act between backward and
    the optimizer step, before gradient clipping (the range test averages gradients across ranks there).
    """
    if is_ddp(trainer):
        with _no_ddp_sync(trainer):
            return _training_step(trainer, pl_module, batch, batch_idx, wrap_closure)
    return _training_step(trainer, pl_module, batch, batch_idx, wrap_closure)


def _training_step(
    trainer: Any, pl_module: Any, batch: Any, batch_idx: int, wrap_closure: ClosureWrapper | None
) -> torch.Tensor | None:
    strategy = trainer.strategy
    legacy = is_legacy(trainer)
    if not pl_module.automatic_optimization:
        # the user's step does backward and step itself; what it returns is up to it (a loss, or nothing)
        output = _forward(trainer, pl_module, batch, batch_idx)
        loss = output.get("loss") if isinstance(output, Mapping) else output
        return loss if isinstance(loss, torch.Tensor) else None
    optimizers = list(trainer.optimizers)
    if len(optimizers) != 1:
        raise RetuneError(
            f"automatic optimization with {len(optimizers)} optimizers is not supported by the probe; "
            "use one optimizer or manual optimization"
        )
    optimizer = optimizers[0]
    marks = _MARKS.get()

    losses: list[torch.Tensor | None] = []
    outputs: list[Any] = []  # alive until the update is done, as the loop's closure result keeps them

    def closure() -> torch.Tensor | None:
        output = _forward(trainer, pl_module, batch, batch_idx)
        outputs[:] = [output]  # the latest only, as the loop's closure keeps it (L-BFGS calls it many times)
        loss = _loss_of(output)
        losses[:] = [loss]
        if marks is not None:
            marks.forward_done()
        # where the loop zeroes: after training_step, before backward (the step before's gradients are alive in
        # this step's forward, so a probe's later steps measure them as training will)
        _zero_grad(trainer, pl_module, optimizer, batch_idx)
        if loss is None:
            return None
        if legacy:
            strategy.backward(loss, optimizer, 0)
        else:
            strategy.backward(loss, optimizer)
        if marks is not None:
            marks.backward_done()
        return loss

    run = closure if wrap_closure is None else wrap_closure(closure)
    if legacy:
        strategy.optimizer_step(optimizer, 0, run, model=pl_module)
    else:
        strategy.optimizer_step(optimizer, run, model=pl_module)
    outputs.clear()
    return losses[-1] if losses else None


_FX_NAMES = {"train": "training_step", "val": "validation_step", "test": "test_step", "predict": "predict_step"}


@contextmanager
def hooks_isolated(trainer: Any, pl_module: Any, stage: str = "train") -> Iterator[None]:
    """Hide probe steps from callbacks, loggers and logged metrics.

    Callbacks and loggers are swapped for none / a dummy logger; ``self.log`` calls go to a throwaway
    result collection. Everything is put back even when the probe raises.

    The progress bar stays: it implements none of the hooks a probe step calls, and
    ``RichProgressBar`` (Lightning's default wherever ``rich`` is installed, as it is with Hugging
    Face's libraries) redraws from its own thread and asserts that ``trainer.progress_bar_callback``
    is still itself: hidden, every redraw during a search printed an ``AssertionError`` traceback.
    """
    ns = namespace_of(trainer)
    owner = results_owner(trainer)
    saved_callbacks = trainer.callbacks
    progress_bar = trainer.progress_bar_callback
    saved_loggers = list(trainer.loggers)
    saved_results = None if owner is None else owner._results
    saved_fx = pl_module._current_fx_name
    dummy = import_module(ns + ".loggers.logger").DummyLogger
    try:
        trainer.callbacks = [] if progress_bar is None else [progress_bar]
        trainer.loggers = [dummy()] if saved_loggers else []
        if owner is not None and saved_results is not None:
            owner._results = throwaway_results(trainer, saved_results, training=stage == "train")
        pl_module._current_fx_name = _FX_NAMES[stage]
        yield
    finally:
        trainer.callbacks = saved_callbacks
        trainer.loggers = saved_loggers
        if owner is not None and saved_results is not None:
            owner._results = saved_results
        pl_module._current_fx_name = saved_fx


_EVAL_STEP_NAMES = {"val": "validation_step", "test": "test_step", "predict": "predict_step"}


def wrap_eval_step(
    pl_module: Any, stage: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Callable[[], None]:
    """Replace the module's ``*_step`` for ``stage`` on this instance with ``wrap(step)``; returns the undo.

    The wrapper keeps what Lightning inspects of the step's signature (``hook_calls.keep_signature``),
    so Lightning passes it the same ``batch_idx``/``dataloader_idx`` it would pass the step.
    """
    name = _EVAL_STEP_NAMES[stage]
    step = getattr(pl_module, name)
    wrapped = hook_calls.keep_signature(wrap(step), step)
    object.__setattr__(pl_module, name, wrapped)

    def undo() -> None:
        if vars(pl_module).get(name) is wrapped:
            object.__delattr__(pl_module, name)

    return undo


__all__ = ["ClosureWrapper", "hooks_isolated", "run_step", "training_step", "wrap_eval_step"]
