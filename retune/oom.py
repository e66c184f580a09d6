"""Which exceptions mean "this batch size does not fit".

A trial fails on an out-of-memory error and only then: every other exception is a bug in the
user's step (or ours) and must reach the user. The messages below are the ones the allocators
actually raise; they are matched by substring because several backends raise plain RuntimeError.

And how to give a failed attempt's memory back, the same way at every place that catches an OOM
(probe trials, train- and eval-step recovery, the learning-rate range test). A caught exception
keeps its traceback, the traceback every frame the error passed through, and each frame its
locals: the failed forward's activations, its loss and graph. While any of that is reachable the
caching allocator cannot reuse the blocks, and the next, smaller attempt starts on a device that
is still full (issue 27: a batch of 48 "recovered" as 48 micro-batches of 1, then died). So a
caller that handles an OOM calls :func:`forget_exception` inside its ``except`` block (the frames'
locals are cleared and the chain dropped), leaves the block (Python then unbinds ``exc``), and
only then calls :func:`clear_device_cache` before running anything again.
"""

from __future__ import annotations

import gc
import traceback

import torch

_OOM_MESSAGES = (
    "CUDA out of memory",  # torch.OutOfMemoryError text on CUDA
    "CUDA error: out of memory",  # OOM surfaced by a CUDA kernel launch
    "HIP out of memory",  # ROCm
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_SUPPORTED",  # cuDNN's answer to an oversized batch (Lightning treats it as OOM)
    "CUDNN_STATUS_ALLOC_FAILED",
    "DefaultCPUAllocator: can't allocate memory",  # CPU allocator
    "DefaultCPUAllocator: not enough memory",  # CPU allocator on Windows
    "MPS backend out of memory",  # Apple MPS
    "XPU out of memory",  # Intel XPU
)


def is_oom_error(exc: BaseException) -> bool:
    """True when ``exc`` says the device ran out of memory.

    Args:
        exc: the exception a training step or probe raised.
    """
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True  # MemoryError: host RAM exhausted by the step's Python side (collate, numpy)
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(message in text for message in _OOM_MESSAGES)


def forget_exception(exc: BaseException) -> None:
    """Drop everything a handled OOM keeps alive: its frames' locals, its traceback, the chain behind it.

    For an error retune handles and does not re-raise. ``traceback.clear_frames`` empties the locals
    of every finished frame (the ones still running, such as the caller's own, are left as they
    are), which also breaks the reference cycles that would otherwise wait for the garbage
    collector; the exceptions it was raised while handling (``__context__``) or from (``__cause__``)
    are cleared the same way and unlinked.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current.__traceback__ = None
        pending.extend((current.__context__, current.__cause__))
        current.__context__ = current.__cause__ = None


def clear_frame_locals(exc: BaseException) -> None:
    """Empty the locals of the frames ``exc`` passed through, keeping the traceback's file and line entries.

    For an OOM retune re-raises to the user (a learning-rate range test step): the message and the
    printed traceback stay as they were, but the exception no longer holds the failed step's tensors,
    so a caller that catches it and goes on has its memory back.
    """
    current: BaseException | None = exc
    seen: set[int] = set()
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        traceback.clear_frames(current.__traceback__)
        current = current.__context__


def _accelerators() -> list[tuple[str, object]]:
    """The torch device modules whose caching allocator is in use in this process (CUDA, XPU, MPS)."""
    found: list[tuple[str, object]] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        found.append(("cuda", torch.cuda))
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available() and getattr(xpu, "is_initialized", lambda: True)():
        found.append(("xpu", xpu))
    mps_backend = getattr(torch.backends, "mps", None)
    if mps_backend is not None and mps_backend.is_available() and hasattr(torch, "mps"):
        found.append(("mps", torch.mps))
    return found


def clear_device_cache(collect: bool = True) -> None:
    """Hand the blocks freed by a failed attempt back to the device, on every device ``is_oom_error`` knows.

    ``collect`` first runs the garbage collector: a reference cycle the caller could not break (one in
    the user's own code) can still hold tensors, and ``empty_cache`` only returns blocks nothing uses.
    Both run only where a device caching allocator is in use: a full collection costs about 0.2 s in a
    process that imported Lightning, and CPU tensors go back to the host allocator as soon as their
    last reference is dropped (which :func:`forget_exception` makes sure of).
    """
    devices = _accelerators()
    if not devices:
        return
    if collect:
        gc.collect()
    for _, module in devices:
        empty_cache = getattr(module, "empty_cache", None)
        if empty_cache is not None:
            empty_cache()


__all__ = ["clear_device_cache", "clear_frame_locals", "forget_exception", "is_oom_error"]
