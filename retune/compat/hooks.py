"""Call a LightningModule's step hooks with the arguments Lightning would pass them.

Lightning does not pass a fixed argument list to ``training_step``, ``validation_step``,
``test_step`` or ``predict_step``: it inspects each hook's signature first. ``batch_idx`` is passed
only to a step that declares it (or any second parameter, or ``*args``) — except that 1.9 always
passes it to the evaluation steps — and ``dataloader_idx`` only when an evaluation stage runs
several loaders one after another. A step written ``def training_step(self, batch)`` is valid
Lightning, so every step retune runs itself (a probe) goes through :func:`step_args`, which asks
the trainer's own ``is_param_in_hook_signature`` (2.x unwraps one decorator level, 1.9 none).

A step retune replaces on the module (the ``oom`` trigger's evaluation recovery) must look to
Lightning exactly as the user's did, or Lightning would choose other arguments for it:
:func:`keep_signature` gives the replacement what Lightning inspects.

Steps that pull their own batches (``dataloader_iter``) cannot be probed at a candidate size:
:func:`check_probeable` refuses them with a message saying so, before a search starts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from retune.compat.namespace import import_module, is_legacy, namespace_of
from retune.errors import RetuneError

STEP_HOOKS = {"train": "training_step", "val": "validation_step", "test": "test_step", "predict": "predict_step"}


def _takes(
    trainer: Any, hook: Callable[..., Any], param: str, explicit: bool = False, min_args: int | None = None
) -> bool:
    """Lightning's own answer to "does this hook take ``param``", from the trainer's Lightning line."""
    signature = import_module(namespace_of(trainer) + ".utilities.signature_utils")
    return bool(signature.is_param_in_hook_signature(hook, param, explicit=explicit, min_args=min_args))


def step_args(
    trainer: Any, pl_module: Any, stage: str, batch: Any, batch_idx: int, dataloader_idx: int | None = None
) -> tuple[Any, ...]:
    """The positional arguments Lightning passes to ``stage``'s step for this batch.

    Training (both lines): ``batch``, then ``batch_idx`` when the step takes it (1.9 with truncated
    BPTT: the batch's first split, ``batch_idx`` as before, and ``hiddens=None``). Evaluation: ``batch``,
    ``batch_idx`` (on 2.x only when the step takes it; 1.9 always passes it), then ``dataloader_idx``
    unless it is None (the loop passes it only when the stage runs several loaders in sequence).
    """
    step = getattr(pl_module, STEP_HOOKS[stage])
    args: list[Any] = [batch]
    if stage == "train":
        tbptt_steps = _tbptt_steps(trainer, pl_module)
        if tbptt_steps:
            args[0] = pl_module.tbptt_split_batch(batch, tbptt_steps)[0]
        if _takes(trainer, step, "batch_idx", min_args=2):
            args.append(batch_idx)
        if tbptt_steps:
            args.append(None)  # hiddens: none yet at a batch's first split
        return tuple(args)
    if is_legacy(trainer) or _takes(trainer, step, "batch_idx", min_args=2):
        args.append(batch_idx)
    if dataloader_idx is not None:
        args.append(dataloader_idx)
    return tuple(args)


def truncated_bptt_steps(trainer: Any, pl_module: Any) -> int:
    """1.9's ``truncated_bptt_steps`` (0: off; 2.x has none): the loop splits each batch in time and carries the
    hidden state from split to split."""
    return _tbptt_steps(trainer, pl_module)


def _tbptt_steps(trainer: Any, pl_module: Any) -> int:
    """1.9's truncated backpropagation through time: the loop runs ``training_step(split, batch_idx, hiddens)``
    on each ``tbptt_split_batch`` split in turn, so a probe step is the first split, as the loop's first step."""
    if not is_legacy(trainer):
        return 0
    return int(getattr(pl_module, "truncated_bptt_steps", 0) or 0)


def call_step(
    trainer: Any, pl_module: Any, stage: str, batch: Any, batch_idx: int, dataloader_idx: int | None = None
) -> Any:
    """Call the module's own step for ``stage`` directly (no strategy wrapper), as Lightning would."""
    step = getattr(pl_module, STEP_HOOKS[stage])
    return step(*step_args(trainer, pl_module, stage, batch, batch_idx, dataloader_idx))


def check_probeable(trainer: Any, pl_module: Any, stage: str) -> None:
    """Refuse a step that takes ``dataloader_iter``: it fetches its own batches, so a probe cannot hand it
    batches of a candidate size (Lightning itself does not transfer them to the device for such a step)."""
    name = STEP_HOOKS[stage]
    if _takes(trainer, getattr(pl_module, name), "dataloader_iter", explicit=True):
        raise RetuneError(
            f"{type(pl_module).__name__}.{name} takes `dataloader_iter`, so it fetches its own batches and retune "
            f"cannot probe it at candidate batch sizes; take `batch` (and `batch_idx`) instead, or remove "
            f"{stage!r} from the schedule's stages"
        )


def keep_signature(replacement: Callable[..., Any], step: Callable[..., Any]) -> Callable[..., Any]:
    """Make ``replacement`` (which calls ``step`` with whatever it receives) look like ``step`` to Lightning.

    ``functools.wraps`` copies the name and docstring and points ``__wrapped__`` at ``step``. Lightning
    2.x unwraps exactly one ``__wrapped__`` level before reading the parameters, so when ``step`` is
    itself decorated, ``__wrapped__`` must skip to what Lightning would have read for ``step``: the
    decorated function, not the decorator's ``(*args, **kwargs)``, which would make it pass every argument.
    """
    wrapped = functools.wraps(step)(replacement)
    inner = getattr(step, "__wrapped__", None)
    if inner is not None:
        wrapped.__wrapped__ = inner
    return wrapped


__all__ = ["STEP_HOOKS", "call_step", "check_probeable", "keep_signature", "step_args", "truncated_bptt_steps"]
