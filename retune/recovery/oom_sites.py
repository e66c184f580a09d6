"""Where in a training step an out-of-memory error was raised, and whether a split batch can recover it.

No Lightning import: Lightning calls every hook through a dispatcher whose frame holds the hook's
name in its argument ``hook_name`` (``_call_lightning_module_hook``, ``_call_callback_hooks``,
``_call_strategy_hook`` on 2.x; the trainer's methods of the same names on 1.9). The innermost such
frame of the exception's traceback is the hook that ran out of memory. Reading it costs nothing
until an error happens, unlike tracking the current hook on every step.

Only the dispatchers' frames are read, recognised by their code's name; the others are never
touched. On Python < 3.13 reading ``f_locals`` stores a snapshot of a frame's locals on the frame,
and the snapshot of the frame that *caught* the error holds the exception itself: a cycle through
the traceback that kept the failed attempt's frames and activations alive for as long as retune's
frame ran, out of the garbage collector's reach (issue 27). A dispatcher's frame has finished by
the time the error is caught and never holds the exception, so its snapshot goes when the caller
drops the exception (:func:`retune.oom.forget_exception`).

Recoverable sites are the ones whose memory grows with the batch and that run again, exactly, when
retune trains the batch as micro-batches: ``training_step``, its backward, and the hooks Lightning
calls between them. The others either run on the whole batch before the step (data transfer and
``on_train_batch_start``), or after the step's gradients are complete (``on_after_backward``,
``on_before_optimizer_step``, clipping, the optimizer step), where a smaller batch needs no less
memory; their OOM is re-raised unchanged, with a note that says where and why.
"""

from __future__ import annotations

from types import TracebackType

from retune.oom import is_oom_error

SPLITTABLE = frozenset(
    {"training_step", "backward", "on_before_backward", "on_before_zero_grad", "optimizer_zero_grad"}
)
"""Sites an OOM in is recovered by training the batch as micro-batches (docs/guides/oom.md lists them)."""

_BEFORE_STEP = frozenset(
    {
        "on_train_batch_start",
        "on_before_batch_transfer",
        "transfer_batch_to_device",
        "on_after_batch_transfer",
        "batch_to_device",
    }
)
_AFTER_GRADIENTS = frozenset(
    {
        "on_after_backward",
        "on_before_optimizer_step",
        "configure_gradient_clipping",
        "clip_gradients",
        "optimizer_step",
        "lr_scheduler_step",
    }
)
NOTE_PREFIX = "retune (oom trigger):"

_DISPATCHERS = frozenset(
    {"_call_lightning_module_hook", "_call_callback_hooks", "_call_strategy_hook", "_call_lightning_datamodule_hook"}
)
"""Lightning's functions (2.x) and trainer methods (1.9) that call a hook by its name, ``hook_name``."""


def oom_site(traceback: TracebackType | None) -> str | None:
    """The Lightning hook (or strategy call) innermost in ``traceback``, or None when none is in it.

    Reads the locals of Lightning's dispatcher frames only (see the module docstring for why).
    """
    site = None
    tb = traceback
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name in _DISPATCHERS:
            name = frame.f_locals.get("hook_name")
            if isinstance(name, str):
                site = name
        tb = tb.tb_next
    return site


def why_not_recovered(site: str | None) -> str:
    """The note added to an OOM raised at ``site`` that retune does not recover."""
    if site in _BEFORE_STEP:
        return (
            f"{NOTE_PREFIX} out of memory in `{site}`, which runs on the whole batch before training_step; retune "
            "splits only training_step, its backward and the hooks between them into micro-batches. Move the "
            "device-side work (GPU augmentation, tokenization) into training_step, or lower the batch size."
        )
    if site in _AFTER_GRADIENTS:
        return (
            f"{NOTE_PREFIX} out of memory in `{site}`, after the batch's gradients were complete; what it works on "
            "(the gradients, the optimizer state) has the same size at any batch size, so micro-batches would not "
            "need less memory and retune does not re-run the step. Free memory there (compute gradient norms under "
            "torch.no_grad, one parameter at a time) or lower what the optimizer keeps."
        )
    where = f"`{site}`" if site else "code outside the training step"
    return (
        f"{NOTE_PREFIX} out of memory in {where}; retune recovers out-of-memory errors in training_step, its backward "
        "and on_before_zero_grad/optimizer_zero_grad/on_before_backward, and in validation_step, test_step and "
        "predict_step (see docs/guides/oom.md, 'Where an OOM is recovered')."
    )


def split_helps(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-memory error that training the batch as micro-batches recovers: one
    raised at a :data:`SPLITTABLE` site, or where no hook can be told. An OOM raised elsewhere gets the
    note :func:`why_not_recovered` writes, for the caller to re-raise.

    >>> split_helps(ValueError("not memory"))
    False
    """
    if not is_oom_error(exc):
        return False
    site = oom_site(exc.__traceback__)
    if site is not None and site not in SPLITTABLE:
        add_note(exc, why_not_recovered(site))
        return False
    return True


def add_note(exc: BaseException, note: str) -> None:
    """Attach ``note`` to ``exc`` once (Python prints notes under the traceback; the type stays the same)."""
    notes = getattr(exc, "__notes__", None) or []
    if any(str(n).startswith(NOTE_PREFIX) for n in notes):
        return
    exc.add_note(note)


__all__ = ["NOTE_PREFIX", "SPLITTABLE", "add_note", "oom_site", "split_helps", "why_not_recovered"]
